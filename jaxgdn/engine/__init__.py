"""The serving engine: scheduler, pools, the step programs and their runner, speculative decoding and PD."""
