"""Engine: requests, KV blocks, scheduling, the step loop."""
