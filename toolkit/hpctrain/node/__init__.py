"""The rank side: what every rank runs. Top down (contract node-parts in pyproject.toml): `launch` (entry,
teardown, pre-flight), `train` (the loop), `checkpointing`, `model`, `data`, `monitor` (metrics, heartbeats,
stacks, trackers), and what they all use: `dist` (distributed start), `runconf` (what the node reads from the run
folder), `phases`, `faultinject`. Imports nothing from the login side (contracts layers and rank-side)."""
