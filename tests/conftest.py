# The real control plane's fixtures (control_plane, node_agent, kueue, namespace, kueue_namespace)
# are available to every test directory.
pytest_plugins = ["tests.cluster.fixtures"]
