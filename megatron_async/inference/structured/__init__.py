"""Structured outputs: what a request's output must match (``spec.StructuredOutputs``) and the
grammar libraries that turn it into a token mask per step (xgrammar, llguidance; ``grammars.py``
routes each spec to one). Importing this package loads neither library: they load on first use,
so an engine without them serves every request that does not ask for a grammar."""
