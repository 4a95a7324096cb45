"""Pod paths -> paths on this machine.

In a pod the model volume is mounted at spec.model.mountPath; locally the
same files sit in the volume's hostPath (or --models-dir, which also stands in
for a PersistentVolumeClaim). Plans speak pod paths; `mtp up` rewrites them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mtp_operator.spec import MtpDeploymentSpec


class LocalPathError(ValueError):
    """A spec path that has no local counterpart; the message says what to pass."""


@dataclass(frozen=True)
class LocalPaths:
    mount_path: PurePosixPath  # where pods see the model volume
    local_root: Path  # where this machine has the same files

    @classmethod
    def for_spec(cls, spec: MtpDeploymentSpec, models_dir: Path | None) -> "LocalPaths":
        if models_dir is None:
            host_path = spec.model.volume.host_path
            if host_path is None:
                raise LocalPathError(
                    f"spec.model.volume.claimName: the PersistentVolumeClaim {spec.model.volume.claim_name!r} "
                    "cannot be mounted locally; pass --models-dir DIR (a folder holding what the claim holds)"
                )
            models_dir = Path(host_path)
        return cls(PurePosixPath(spec.model.mount_path), Path(models_dir).resolve())

    def to_local(self, pod_path: str) -> Path:
        path = PurePosixPath(pod_path)
        if path == self.mount_path:
            return self.local_root
        try:
            relative = path.relative_to(self.mount_path)
        except ValueError:
            raise LocalPathError(f"{pod_path} is not under the model volume's mountPath {self.mount_path}") from None
        return self.local_root.joinpath(*relative.parts)

    def is_pod_path(self, text: str) -> bool:
        return text == str(self.mount_path) or text.startswith(f"{self.mount_path}/")

    def rewrite_argv(self, argv: list[str]) -> list[str]:
        """Every argument (or `--flag=value` value) that is a pod path, made local."""
        out = []
        for arg in argv:
            flag, eq, value = arg.partition("=")
            if eq and flag.startswith("-") and self.is_pod_path(value):
                out.append(f"{flag}={self.to_local(value)}")
            elif self.is_pod_path(arg):
                out.append(str(self.to_local(arg)))
            else:
                out.append(arg)
        return out
