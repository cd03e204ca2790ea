"""Deployment files for pdserve (Dockerfiles, docker-compose, Kubernetes, Grafana) and two small
stdlib-only helpers: ``healthcheck`` (the container HEALTHCHECK probe) and ``kustomize_lite`` (an offline
renderer for the kustomize overlays, used by the tests). See docs/deploy.md."""
