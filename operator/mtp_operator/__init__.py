"""mtp_operator: the Kubernetes operator for MtpDeployment resources.

The folder on disk is `operator/`, but it is never itself a package: the import
name is `mtp_operator`, so the standard library's `operator` is never shadowed.
"""

__version__ = "0.1.0"
