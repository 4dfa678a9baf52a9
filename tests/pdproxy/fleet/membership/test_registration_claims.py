"""What an admitted registration key may make the proxy hold, played through
``RegistrationListener.accept`` (no socket: the rules without timing). The socket-level attacks
(no key, oversized or garbage input, squatting, revocation) are in ``test_registration_attacker``.

- any sequence of messages from admitted keys gets a known outcome, never an exception, and
  leaves configured backends and the registrant cap alone;
- announced model names are capped per key and in all, and forgotten when no backend serves them;
- a registrant never takes a name config or DNS owns or will own, and an operator's removal or
  drain of a registrant sticks.
"""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.errors import ModelNotFound
from pdproxy.fleet.backends import BackendRegistry
from pdproxy.fleet.membership.dns import backend_config
from pdproxy.fleet.membership.members import Membership
from pdproxy.fleet.membership.registration import RegistrationListener
from pdproxy.fleet.models import OTHER_LABEL, ModelCatalog
from pdproxy.routing.base import Role
from pdproxy.settings import BackendConfig, BreakerSettings
from pdproxy.settings.membership import (
    DnsDiscoverySettings,
    DnsGroup,
    MembershipSettings,
    RegistrationSettings,
)
from pdproxy.settings.models import ModelsSettings
from tests.pdproxy.fleet.membership.registrant import vllm_message

_OUTCOMES = {"joined", "refreshed", "left", "unknown", "malformed", "address", "full", "conflict",
             "owner", "rate"}  # fmt: skip
_value = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=40),
    st.binary(max_size=40),
    st.lists(st.text(max_size=10), max_size=4),
    st.sampled_from(["P", "D", "PD", "127.0.0.1:8100", "10.0.0.1:1", "tcp://127.0.0.1:5557",
                     "tcp://*:1", "static", "nixl"]),
)  # fmt: skip
_message = st.one_of(
    st.binary(max_size=300),
    st.dictionaries(
        st.sampled_from(["type", "http_address", "zmq_address", "name", "models", "dialect",
                         "events_endpoint", "leaving", "extra"]),
        _value, max_size=9,
    ).map(lambda d: msgpack.dumps(d, use_bin_type=True)),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(messages=st.lists(_message, max_size=30), keys=st.lists(st.sampled_from("abc"), max_size=30))
def test_any_message_sequence_keeps_the_invariants(messages: list[bytes], keys: list[str]) -> None:
    """Whatever admitted keys send: every message gets a known outcome (never an exception),
    the configured backend is untouched, and the registrant cap holds."""
    registry = BackendRegistry(BreakerSettings())
    static = registry.add(
        BackendConfig(name="static", url="http://127.0.0.1:9", role=Role.CONSUMER)
    )
    membership = Membership(registry, MembershipSettings())
    settings_ = RegistrationSettings(max_registrants=3, max_messages_per_key_s=1000)
    listener = RegistrationListener(settings_, membership)
    for i, payload in enumerate(messages):
        key = keys[i % len(keys)] if keys else "a"
        assert listener.accept(payload, key * 40, "127.0.0.1") in _OUTCOMES
    assert registry.get("static") is static and not static.draining
    assert len(membership.members()) <= 3
    for member in membership.members():
        assert member.backend.url.startswith("http://127.0.0.1:")


# -- issue 30: findings 6 and 7, played by an admitted key


def _offline(
    settings: MembershipSettings | None = None, **registration: object
) -> tuple[BackendRegistry, Membership, RegistrationListener]:
    """A listener fed through ``accept`` (no socket): its rules without timing."""
    registry = BackendRegistry(BreakerSettings())
    registry.add(BackendConfig(name="static", url="http://127.0.0.1:9", role=Role.CONSUMER))
    membership = Membership(registry, settings or MembershipSettings(drain_grace_s=0))
    values: dict[str, object] = {"max_messages_per_s": 1e6, "max_messages_per_key_s": 1e6}
    listener = RegistrationListener(
        RegistrationSettings.model_validate(values | registration), membership
    )
    return registry, membership, listener


def _announce(listener: RegistrationListener, key: str, port: int, **extra: object) -> str:
    message = vllm_message("P", port) | extra
    return listener.accept(msgpack.dumps(message), key * 40, "127.0.0.1")


def _label(catalog: ModelCatalog, model: str) -> str | None:
    """The metric label (and router, admission bucket) a request for ``model`` gets."""
    try:
        ref = catalog.resolve({"model": model})
    except ModelNotFound:
        return None
    return ref.label if ref is not None else None


def test_announced_models_are_bounded_and_what_no_backend_serves_is_forgotten() -> None:
    """Finding 6: every model name a registrant announced became a known model (a metric label,
    a per-model router, an admission bucket) and was never forgotten: 80 announcements made
    2,496 labels. Now one key may announce at most ``max_models_per_key`` names, all keys
    ``max_models``, and a name no backend serves any more leaves the catalog, which tells its
    watchers (routing and admission drop what they hold for it)."""
    registry, membership, listener = _offline()
    catalog = ModelCatalog(ModelsSettings(), registry)
    labels: set[str] = set()
    for key in "abcdefgh":  # 8 keys x 8 backends x 8 fresh names = 512 names offered
        for i in range(8):
            models = [f"junk-{key}-{i}-{n}" for n in range(8)]
            _announce(listener, key, 8100 + ord(key) * 10 + i, models=models)
            labels.update(label for m in models if (label := _label(catalog, m)) is not None)
        by_key = {m for m in catalog.known() if m.startswith(f"junk-{key}-")}
        assert len(by_key) <= 16, f"key {key} made {len(by_key)} known models"
    labels.discard(OTHER_LABEL)
    assert len(labels) <= 64, f"{len(labels)} labels handed out"
    assert len(catalog.known()) <= 64
    forgotten: list[str] = []
    catalog.on_forget(forgotten.extend)
    handed_out: set[str] = set(catalog.known())
    for round_ in range(80):  # one key churns its backend's models
        models = [f"churn-{round_}-{n}" for n in range(8)]
        _announce(listener, "a", 8100 + ord("a") * 10, models=models)
        handed_out.update(label for m in models if (label := _label(catalog, m)) is not None)
        assert len(catalog.known()) <= 64
    gone = handed_out - set(catalog.known())
    assert gone and gone <= set(forgotten)
    for member in membership.members():  # every registrant leaves: its names are forgotten
        membership.leave(member.name, "test")
    membership.sweep()
    assert catalog.known() == [] and handed_out <= set(forgotten)


def test_a_registrant_cannot_take_a_name_config_or_dns_owns_or_will_own() -> None:
    """Finding 7: a registrant took ``prefill-<ip>-<port>`` before DNS found that backend and
    received its traffic. Names in a DNS group's namespace, configured names (even after an
    admin removed the backend) and another address's generated ``reg-`` name are refused."""
    group = DnsGroup(name="prefill", query="prefill.example", port=8200, role=Role.PRODUCER)
    settings = MembershipSettings(dns=DnsDiscoverySettings(groups=[group]), drain_grace_s=0)
    registry, membership, listener = _offline(settings)
    dns_name = backend_config(group, "127.0.0.1", 8200).name
    assert _announce(listener, "a", 8200, name=dns_name) == "conflict"
    assert _announce(listener, "a", 8201, name="prefill-10.0.0.9-8000") == "conflict"
    assert _announce(listener, "a", 8202, name="reg-127.0.0.2-8202") == "conflict"
    registry.remove("static")  # DELETE /admin/backends/static: the name stays the config's
    assert _announce(listener, "a", 8203, name="static") == "conflict"
    membership.sync("dns", "prefill", [backend_config(group, "127.0.0.1", 8200)])
    member = membership.get(dns_name)
    assert member is not None and member.source == "dns"
    assert _announce(listener, "a", 8204) == "joined"  # its own generated name is fine


def test_an_operators_removal_or_drain_of_a_registrant_sticks() -> None:
    """Finding 7: an admin DELETE or drain of a registered backend was undone by its next
    announcement (5/10 requests back on it within 2 s). It now stays out until re-admitted."""
    registry, membership, listener = _offline()
    removed, drained = "reg-127.0.0.1-8100", "reg-127.0.0.1-8101"
    assert _announce(listener, "a", 8100) == "joined"
    registry.remove(removed)  # DELETE /admin/backends/reg-127.0.0.1-8100
    for _ in range(3):
        assert _announce(listener, "a", 8100) == "removed"
        membership.sweep()
    assert registry.get(removed) is None
    assert _announce(listener, "a", 8101) == "joined"
    backend = registry.get(drained)
    assert backend is not None
    backend.draining = True  # POST /admin/backends/reg-127.0.0.1-8101/drain
    _announce(listener, "a", 8101)
    _announce(listener, "a", 8101, zmq_address="127.0.0.1:21002")  # a changed config
    live = registry.get(drained)
    assert live is not None and live.draining and not live.routable
    assert _announce(listener, "a", 8101, leaving=True) == "left"
    assert membership.sweep() == [drained]
    assert _announce(listener, "a", 8101) == "removed" and registry.get(drained) is None
    membership.readmit(removed)  # the operator takes it back
    assert _announce(listener, "a", 8100) == "joined"
    assert registry.get(removed) is not None and registry.get(drained) is None
