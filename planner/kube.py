"""The planner's hands: the `scale` subresource of each pool's Deployment, through the
official Kubernetes client. In a pod it authenticates as its ServiceAccount (the chart's
Role allows get and patch on deployments/scale, and reading pods, in its namespace);
`--kubeconfig` is for running it elsewhere."""
from __future__ import annotations

from pathlib import Path

from kubernetes import client, config

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Deployments:
    def __init__(self, namespace: str | None, kubeconfig: str | None = None) -> None:
        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
        self.namespace = namespace or SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        self._apps = client.AppsV1Api(api)

    def replicas(self, name: str) -> int:
        """The count the Deployment asks for (pods still starting included)."""
        return self._apps.read_namespaced_deployment_scale(name, self.namespace).spec.replicas or 0

    def scale(self, name: str, replicas: int) -> None:
        # A merge patch of the scale's spec: nothing but the count changes, and a
        # Deployment's own controller then adds pods, or removes the not-ready ones first.
        self._apps.patch_namespaced_deployment_scale(name, self.namespace, {"spec": {"replicas": replicas}},
                                                     _content_type="application/merge-patch+json")
