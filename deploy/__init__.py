"""Deployment files for pdserve (Dockerfiles, docker-compose, Kubernetes, Grafana) and two small
helpers: ``healthcheck`` (the container HEALTHCHECK probe, stdlib only) and ``kustomize_lite`` (an offline
renderer for the kustomize overlays, used by the tests; PyYAML). See docs/deploy.md."""
