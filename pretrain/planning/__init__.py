"""What a run costs before it starts: parameters, FLOPs and MFU (`flops`), the memory plan
(`memory`), data parallelism projected to N GPUs (`scaling`)."""
