"""The cost model: what a profile holds (`profile`), a plan's predicted throughput (`model`), the tuner
(`tune`) and the shard balancer for dense tables (`balance`)."""
