"""The local backend of `mtp up`: realises a DeploymentPlan as processes on
this machine (export step, then one process per rank on loopback) and feeds
what it observes to the same observe -> status code as the operator."""
