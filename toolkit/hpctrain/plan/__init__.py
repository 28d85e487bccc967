"""Derived facts from a spec: parallel degrees, batch arithmetic, the memory model, chosen ZeRO stage and offload."""
