"""Command-line plumbing that the main job, the server and the examples share: flag groups and the
``InferenceConfig`` / ``SamplingParams`` they build (``flags``), model loading and the main job
(``main_job``), its workloads, driver loop and printed summary."""
