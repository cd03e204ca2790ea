"""KV transfer benchmarks: bandwidth against a peer copy, the sender's cost to a producer thread, the post
path, and the --trace summary."""
