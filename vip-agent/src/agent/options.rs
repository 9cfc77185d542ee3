//! What `vip-agent run` is given: [`Options`], built from the command line
//! ([`Options::from_args`]) by the binary and by the tests that run the agent
//! in-process, so both run the agent the DaemonSet runs.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::{bail, Result};

use super::Source;
use crate::{cli::RunArgs, dataplane::AttachMode, ha::garp::ArpSender};

/// How `run` is set up (the CLI fills it).
#[derive(Clone, Debug)]
pub struct Options {
    pub source: Source,
    /// This node's name in the config's `nodes`.
    pub node_name: String,
    /// The interface of pools that name none, and this node's home (where the
    /// node is reached); None: each pool's by its addresses, home by the node's.
    pub iface: Option<String>,
    pub attach_mode: AttachMode,
    pub pin_dir: PathBuf,
    pub ring_capacity: u32,
    /// /metrics, /healthz, /readyz, /status; None: no HTTP server.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the status JSON is written after every change (read by `inspect`).
    pub status_file: Option<PathBuf>,
    /// How often the config file is checked for changes.
    pub reload_interval: Duration,
    /// How gratuitous ARP and ARP requests leave the node.
    pub arp_sender: ArpSender,
    /// How often each VIP held elsewhere and checked here is asked for (the ARP
    /// self-check, `ha::arpcheck`); zero: never.
    pub arp_check_interval: Duration,
    /// Where the cluster's heartbeat key comes from.
    pub heartbeat_key: HeartbeatKey,
    /// FRR, for `announce: bgp` pools.
    pub frr: crate::bgp::frr::Paths,
}

/// Where the cluster's heartbeat key comes from.
#[derive(Clone, Debug)]
pub enum HeartbeatKey {
    /// A key file, re-read every few seconds (rotation).
    File(PathBuf),
    /// This Secret in the agent's namespace (Kubernetes), created when absent and
    /// watched (`k8s::heartbeat_key`).
    Secret(String),
    /// None: the segment is trusted and heartbeats go unsigned.
    Trusted,
}

impl Options {
    /// The options `vip-agent run` is started with (`pin_dir`: the global `--pin-dir`).
    pub fn from_args(r: RunArgs, pin_dir: PathBuf) -> Result<Self> {
        let heartbeat_key = match (r.heartbeat_key_file, r.trusted_segment) {
            (Some(file), _) => HeartbeatKey::File(file),
            (None, true) => HeartbeatKey::Trusted,
            (None, false) if r.kubernetes => HeartbeatKey::Secret(r.heartbeat_secret),
            (None, false) => bail!(
                "heartbeats need a cluster key: --heartbeat-key-file FILE (one key of at least 32 bytes per line, the same \
                 file on every node; make one with `head -c 48 /dev/urandom | base64`), or --trusted-segment to run \
                 without authentication on a segment you trust"
            ),
        };
        let source = match r.config {
            Some(path) => Source::File(path),
            None => {
                let (announce, failover) = r.timers.model()?;
                Source::Kubernetes { lease_namespace: r.lease_namespace, kubeconfig: r.kubeconfig, announce, failover, sync_timeout: r.sync_timeout }
            }
        };
        let node_name = match r.node_name {
            Some(n) => n,
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")?.trim().to_owned(),
        };
        let metrics_addr = match r.metrics_addr.as_str() {
            "off" => None,
            a => Some(crate::cli::metrics_addr(a)?),
        };
        Ok(Self {
            source,
            node_name,
            iface: r.iface,
            attach_mode: r.mode,
            pin_dir,
            ring_capacity: r.ring_capacity,
            metrics_addr,
            status_file: Some(r.status_file),
            reload_interval: r.reload_interval,
            arp_sender: r.arp_sender,
            arp_check_interval: r.arp_check_interval,
            frr: crate::bgp::frr::Paths { config: r.frr_config, vty_dir: r.frr_vty_dir, reload: r.frr_reload, vtysh: r.vtysh },
            heartbeat_key,
        })
    }
}
