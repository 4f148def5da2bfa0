"""cgpu-scheduler: a kube-scheduler extender that places GPU shares from
every node's Capacity stream (see docs/scheduler.md)."""
