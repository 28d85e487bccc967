"""What a rank reports while it trains: logs and metrics, heartbeats, GPU stats, stack dumps, trackers."""
