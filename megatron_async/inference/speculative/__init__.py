"""Speculative decoding: the drafter interface, the device-side verify step, the drafters."""
