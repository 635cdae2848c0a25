"""The one error type of the local cluster, in a module of its own so that ``install``, ``daemons`` and the
``cluster`` facade can all raise it without importing one another."""


class ClusterError(RuntimeError):
    """A daemon failed to start or stop, or a package could not be installed (CLI exit status 1).

    Kept apart from :class:`bridge_hpc.contracts.errors.ConfigError` (exit status 2, bad input) because the
    user cannot fix these by changing what they typed: the machine or a daemon is at fault.
    """
