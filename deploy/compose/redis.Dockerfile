# Redis for compose.yaml where no registry answers (scripts/compose.py builds it on the base it
# imported from Debian's packages, which include redis-server with TLS): the same shape as the
# official image compose.yaml names by default, a non-root user, /data its only writable place,
# here uid 10001 like every specdec process.
ARG BASE=specdec-base:bookworm
FROM ${BASE}
RUN usermod -u 10001 redis && groupmod -g 10001 redis \
    && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
