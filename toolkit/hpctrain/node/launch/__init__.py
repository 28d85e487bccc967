"""Starting a rank: the callable submitit pickles (entry), the entrypoint that owns teardown and exit codes
(main), the pre-flight rendezvous, the wait for an ended step's ranks, a user's own script, the health check."""
