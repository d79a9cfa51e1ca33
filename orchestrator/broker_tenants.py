"""Per-tenant broker identities: each task namespace's daemons get a broker user of their
own, which may consume only that namespace's queues and publish only to the
orchestrator's queue (and Celery's monitoring events), so a pod of one namespace can
neither read, purge nor publish to another's queues.

The operator makes the user (``Tenants.ensure``) through an admin connection only it
holds (``DRAIN_BROKER_ADMIN_URL``), each time it provisions a task of the namespace, and
writes the user's URL to the namespace's broker Secret, which is all a pod ever reads.
The user's name and password are derived from the message key (``DRAIN_MESSAGE_KEY``),
so every operator replica makes the same user and nothing has to be stored.

- **Redis** (``redis://`` admin URL, Redis 7's ACLs): keys ``caliband.<ns>.*`` (the
  namespace's queues, and the unacknowledged-message keys its consumers keep apart from
  everyone else's, ``contract.daemon_celery_config``) and their kombu bindings; write-only
  the orchestrator's queue; read-only the orchestrator's and the events' bindings; the
  result keys (``celery-task-meta-*``, written by a daemon's tasks; their ids are
  unguessable and ``SCAN``/``KEYS`` are refused, and what a daemon stores is signed);
  publish-only on the result and event channels; no subscribing, no admin or dangerous
  command.
- **RabbitMQ** (``http(s)://`` admin URL, the management plugin's API): configure, write
  and read on ``caliband.<ns>.*`` only, write on the orchestrator's and the events'
  exchanges, configure on the events' exchange (RabbitMQ cannot grant declaring an
  exchange without deleting it).

The embedded broker of ``drainctl dev up`` has no users: it enforces none of this.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Final, Protocol

from worker_agent.contract import (
    AMQP_SCHEMES,
    ORCHESTRATOR_QUEUE,
    TENANT_USER_PREFIX,
    url_scheme,
)

log = logging.getLogger(__name__)

EVENTS_EXCHANGE: Final = "celeryev"
RESULT_KEYS: Final = "celery-task-meta-*"
ADMIN_TIMEOUT_SECS: Final = 10.0
REDIS_SCHEMES: Final = frozenset({"redis", "rediss"})
ADMIN_SCHEMES: Final = frozenset({"redis", "rediss", "http", "https"})


class TenantError(Exception):
    """The broker refused or could not be asked to make a tenant's user; one line."""


def _derive(key: bytes, purpose: str, namespace: str) -> str:
    return hmac.new(key, f"{purpose}\0{namespace}".encode(), hashlib.sha256).hexdigest()


def user_name(key: bytes, namespace: str) -> str:
    """``caliban-drain.<ns>.<8 hex>``: the namespace, and a fingerprint of the key, so
    stacks with different keys sharing a broker never reset each other's users."""
    return f"{TENANT_USER_PREFIX}{namespace}.{_derive(key, 'broker-user-name', '')[:8]}"


def password(key: bytes, namespace: str) -> str:
    return _derive(key, "broker-user-password", namespace)


def with_credentials(url: str, user: str, secret: str) -> str:
    """``url`` with its user and password replaced by ``user``/``secret``."""
    parts = urllib.parse.urlsplit(url)
    quoted = f"{urllib.parse.quote(user, safe='')}:{urllib.parse.quote(secret, safe='')}"
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{quoted}@{_host_port(parts)}"))


def redis_rules(namespace: str, secret: str) -> list[str]:
    """The ``ACL SETUSER`` rules of namespace ``namespace``'s user (after its name)."""
    own = f"caliband.{namespace}."
    return [
        "reset",
        "on",
        f"#{hashlib.sha256(secret.encode()).hexdigest()}",
        f"~{own}*",
        f"~_kombu.binding.{own}*",
        f"~_kombu.binding_permanent.{own}*",
        f"%R~_kombu.binding.{ORCHESTRATOR_QUEUE}",
        f"%R~_kombu.binding.{EVENTS_EXCHANGE}",
        f"%W~{ORCHESTRATOR_QUEUE}",
        f"~{RESULT_KEYS}",
        f"&{RESULT_KEYS}",
        f"&/*.{EVENTS_EXCHANGE}/*",
        "+@all",
        "-@admin",
        "-@dangerous",
        "-@pubsub",
        "+publish",
        "-scan",
        "-keys",
        "-randomkey",
    ]


def rabbitmq_permissions(namespace: str) -> dict[str, str]:
    """The vhost permissions of namespace ``namespace``'s user (regular expressions over
    queue and exchange names)."""
    own = rf"caliband\.{re.escape(namespace)}\.[^.].*"
    orchestrator = re.escape(ORCHESTRATOR_QUEUE)
    return {
        "configure": rf"^({own}|{EVENTS_EXCHANGE})$",
        "write": rf"^({own}|{orchestrator}|{EVENTS_EXCHANGE})$",
        "read": rf"^({own})$",
    }


class Tenants(Protocol):
    def ensure(self, namespace: str) -> str:
        """Make (or make equal again) ``namespace``'s user; answer the URL its daemons
        use. Raises ``TenantError``."""
        ...


@dataclass(frozen=True)
class RedisTenants:
    admin_url: str
    daemon_url: str
    key: bytes

    def ensure(self, namespace: str) -> str:
        import redis

        user, secret = user_name(self.key, namespace), password(self.key, namespace)
        try:
            with redis.Redis.from_url(
                self.admin_url,
                socket_timeout=ADMIN_TIMEOUT_SECS,
                socket_connect_timeout=ADMIN_TIMEOUT_SECS,
            ) as admin:
                admin.execute_command("ACL", "SETUSER", user, *redis_rules(namespace, secret))
        except redis.RedisError as exc:
            raise TenantError(f"Redis refused the tenant user {user}: {exc}") from None
        return with_credentials(self.daemon_url, user, secret)


@dataclass(frozen=True)
class RabbitTenants:
    admin_url: str
    daemon_url: str
    key: bytes

    def ensure(self, namespace: str) -> str:
        user, secret = user_name(self.key, namespace), password(self.key, namespace)
        vhost = urllib.parse.unquote(urllib.parse.urlsplit(self.daemon_url).path[1:]) or "/"
        quoted = urllib.parse.quote(user, safe="")
        self._put(f"users/{quoted}", {"password": secret, "tags": ""})
        where = f"permissions/{urllib.parse.quote(vhost, safe='')}/{quoted}"
        self._put(where, rabbitmq_permissions(namespace))
        return with_credentials(self.daemon_url, user, secret)

    def _put(self, path: str, body: dict[str, str]) -> None:
        parts = urllib.parse.urlsplit(self.admin_url)
        base = urllib.parse.urlunsplit(parts._replace(netloc=_host_port(parts), path=""))
        # The scheme is http(s): ``check_admin_url`` refused any other.
        url, data = f"{base}/api/{path}", json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method="PUT")  # noqa: S310
        token = f"{urllib.parse.unquote(parts.username or '')}:" + urllib.parse.unquote(
            parts.password or ""
        )
        request.add_header("Authorization", "Basic " + base64.b64encode(token.encode()).decode())
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=ADMIN_TIMEOUT_SECS):  # noqa: S310
                return
        except urllib.error.HTTPError as exc:
            raise TenantError(
                f"RabbitMQ's management API refused PUT /api/{path.split('/')[0]}: "
                f"{exc.code} {exc.reason}"
            ) from None
        except OSError as exc:
            raise TenantError(f"RabbitMQ's management API did not answer: {exc}") from None


def _host_port(parts: urllib.parse.SplitResult) -> str:
    """``host:port`` of ``parts`` without its credentials (an IPv6 literal bracketed)."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return host if parts.port is None else f"{host}:{parts.port}"


def check_admin_url(admin_url: str, daemon_url: str) -> None:
    """Refuse, in one line, an admin URL that cannot make users for ``daemon_url``'s
    broker: Redis's by a ``redis://`` URL, RabbitMQ's by its management API's."""
    admin, daemon = url_scheme(admin_url), url_scheme(daemon_url)
    if admin not in ADMIN_SCHEMES:
        raise ValueError(
            f"DRAIN_BROKER_ADMIN_URL: scheme {admin!r} is neither redis(s):// (Redis's "
            "ACLs) nor http(s):// (RabbitMQ's management API)"
        )
    if daemon in REDIS_SCHEMES and admin not in REDIS_SCHEMES:
        raise ValueError("DRAIN_BROKER_ADMIN_URL: a Redis broker's users are made with redis://")
    if daemon in AMQP_SCHEMES and admin not in ("http", "https"):
        raise ValueError(
            "DRAIN_BROKER_ADMIN_URL: a RabbitMQ broker's users are made through its "
            "management API, http(s)://HOST:15672"
        )
    if daemon not in REDIS_SCHEMES and daemon not in AMQP_SCHEMES:
        raise ValueError(f"DRAIN_BROKER_ADMIN_URL: a {daemon}:// broker has no users to make")


def tenants_for(admin_url: str | None, daemon_url: str, key: bytes | None) -> Tenants | None:
    """The tenants of the daemons' broker, or None where the operator makes none
    (no admin URL). The settings have checked the URLs and that a key is set."""
    if admin_url is None:
        return None
    if key is None:
        raise ValueError("DRAIN_BROKER_ADMIN_URL needs DRAIN_MESSAGE_KEY")
    if url_scheme(daemon_url) in REDIS_SCHEMES:
        return RedisTenants(admin_url, daemon_url, key)
    return RabbitTenants(admin_url, daemon_url, key)
