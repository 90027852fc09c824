"""PD's settings checked against the world before anything starts: the shared key can be read (its
file, or the environment), a server whose PD sockets leave loopback has one, and the Mooncake transfer
engine is installed when it is asked for. The values alone are ``DisaggregationSettings.check``'s
(config stays free of the disk, the environment and this package); the composition root runs this
one after it (``launch/validate.py``), from the CLI before anything starts and again in the engine."""

from __future__ import annotations

from ..common.disagg import PrefillPeers, is_loopback
from ..config import DisaggregationSettings
from ..errors import ValidationError
from .auth import ENV_KEY, load_key
from .mooncake import available


def check_pd_settings(d: DisaggregationSettings) -> None:
    """Refuse PD settings the machine cannot serve safely (a ``ValidationError`` naming the flag);
    nothing without ``--disaggregation-mode``."""
    if not d.enabled:
        return
    try:
        key = load_key(d.disaggregation_auth_key_file)
    except ValueError as e:
        raise ValidationError(str(e), param="disaggregation_auth_key_file") from None
    peers = PrefillPeers(d.disaggregation_prefill_peers, d.disaggregation_bootstrap_port)
    if key is None:
        # Without a key anyone who reaches a PD socket is trusted: only loopback may go without.
        exposed = None
        if d.disaggregation_mode == "prefill" and not is_loopback(d.disaggregation_bind_host):
            exposed = f"its bootstrap port binds {d.disaggregation_bind_host}"
        elif d.disaggregation_mode == "decode" and not peers.all_loopback:
            exposed = f"it fetches KV from {', '.join(peers.describe())}"
        if exposed is not None:
            raise ValidationError(
                f"a PD server whose sockets leave loopback needs the PD nodes' shared key ({exposed}): "
                f"--disaggregation-auth-key-file PATH or {ENV_KEY} (e.g. `openssl rand -hex 32`)",
                param="disaggregation_auth_key_file",
            )
    if d.disaggregation_transfer_backend == "mooncake":
        why = available()
        if why is not None:
            raise ValidationError(
                f"the mooncake transfer backend is not installed: {why}", param="disaggregation_transfer_backend"
            )
