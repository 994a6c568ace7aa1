//! The agent as a whole: the real `kproxy` binary, its command line and configuration, its
//! HTTP servers and metrics (checked by `promtool`), the deploy manifests, the container image
//! run with podman as the DaemonSet describes it, and the Grafana dashboard. One test binary
//! for these files (see tests/README.md).

mod agent_cgroup;
mod agent_modes;
mod agent_node_cidr;
mod agent_restart;
mod cli_config;
mod deploy_grafana;
mod deploy_image;
mod deploy_manifests;
mod health_checknodeport;
mod health_server;
mod inspect_api;
mod inspect_iptables;
mod inspect_nftables;
mod metrics_promtool;
mod metrics_server;
mod nftables_localhost;
