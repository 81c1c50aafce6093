"""What the tests share: tiny checkpoints, event logs, traces, a fake Hub, scripted GUI clients."""
