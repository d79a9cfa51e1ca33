#!/usr/bin/env bash
# Start the local servers the integration tests use, when they are installed but down.
# A server that is not installed is reported; the tests that need it say so and skip.
set -u

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
  for _ in $(seq 1 50); do port_open "$1" && return 0; sleep 0.2; done
  return 1
}

if port_open 6379; then
  echo "redis: up on 127.0.0.1:6379"
elif command -v redis-server >/dev/null 2>&1; then
  echo "redis: starting"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/caliban-drain-redis.log
  wait_port 6379 && echo "redis: up" || echo "redis: did not come up (see /tmp/caliban-drain-redis.log)"
else
  echo "redis: not installed; tests that need it will skip"
fi

if port_open 5432; then
  echo "postgresql: up on 127.0.0.1:5432"
elif command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
  echo "postgresql: starting"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  wait_port 5432 && echo "postgresql: up" || echo "postgresql: did not come up"
else
  echo "postgresql: not installed; tests that need it will skip"
fi
if port_open 5672; then
  echo "rabbitmq: up on 127.0.0.1:5672"
elif command -v rabbitmq-server >/dev/null 2>&1; then
  echo "rabbitmq: starting"
  # Its management API (for the per-tenant broker users' tests) on 127.0.0.1 only.
  RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-rabbitmq_management tcp_config [{ip,"127.0.0.1"},{port,15672}]' \
    rabbitmq-server -detached || true
  # The node takes a few seconds to boot before it listens.
  for _ in $(seq 1 3); do wait_port 5672 && break; done
  port_open 5672 && echo "rabbitmq: up" || echo "rabbitmq: did not come up (see rabbitmqctl status)"
else
  echo "rabbitmq: not installed; the amqp variants of the pipeline tests will skip"
fi
if port_open 5672 && ! port_open 15672 && command -v rabbitmq-plugins >/dev/null 2>&1; then
  echo "rabbitmq: enabling its management API on 127.0.0.1:15672"
  rabbitmqctl eval 'application:load(rabbitmq_management), application:set_env(rabbitmq_management, tcp_config, [{ip, "127.0.0.1"}, {port, 15672}]).' >/dev/null 2>&1 || true
  rabbitmq-plugins enable rabbitmq_management >/dev/null 2>&1 || true
  wait_port 15672 && echo "rabbitmq management: up" || echo "rabbitmq management: did not come up; the RabbitMQ tenant tests will skip"
fi
exit 0
