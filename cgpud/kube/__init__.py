"""The node agent for Kubernetes: the kubelet device plugin, the pods it
serves and the Node that describes this host."""
