"""The node core: instance tables, placement (the one admission), regions,
the compute binding, process mapping and the bypass watchdog. The faces
(api, containers, kube) and the extender import it; it imports none of them."""
