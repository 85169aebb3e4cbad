"""Wiring: ClusterConfig (YAML args + environment), build_app for Serve, a local Ray runner, the CLI.

Modules: ``config`` (ClusterConfig, Environment), ``app`` (build_app / compose_app), ``local``
(start Ray + Serve, wait for /ready, Ctrl-C to stop), ``cli`` (the ``pdserve`` command).
"""
