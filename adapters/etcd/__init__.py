"""rallypoint.adapters.etcd."""
