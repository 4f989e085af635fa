"""Against the sandbox cluster: real sshd + dockerd per node, namespaced links (marker sandbox)."""
