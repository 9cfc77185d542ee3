//! The agent's published view (status file, `/status`): what `inspect`, the
//! labs and humans read. Below both the agent, which writes it, and `inspect`.
use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::{
    dataplane::Usage,
    model::{HealthCheck, Probe},
};

/// The agent's view, published as JSON (status file, /status) for `inspect` and humans.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub node: String,
    /// When the agent wrote this status, in milliseconds since the Unix epoch. The
    /// agent rewrites it after every change and at least every 30 s, so an old
    /// one means the agent is not running (0: written by an agent before this field).
    #[serde(default)]
    pub updated_unix_ms: u64,
    pub config: ConfigStatus,
    /// VIP → owner node.
    pub owners: BTreeMap<IpAddr, String>,
    pub held: Vec<IpAddr>,
    pub services: Vec<ServiceStatus>,
    /// Service-ports the model wants that could not be programmed, with why
    /// (retried every second and after every change).
    pub unprogrammed: Vec<UnprogrammedStatus>,
    /// How full the data path's tables are.
    pub usage: Usage,
    pub nodes: Vec<NodeStatus>,
    pub health: Vec<HealthStatus>,
    /// Recent health change → maps updated latencies, microseconds (newest last, at most 256).
    pub health_to_maps_us: Vec<u64>,
    /// What is wrong with this host for the VIP traffic it gets (VIP not on `lo`,
    /// loose ARP sysctls); empty when ready. See `vip-agent check`.
    #[serde(default)]
    pub host_problems: Vec<String>,
    /// Peers whose cluster-wide settings differ from this agent's, each with
    /// the settings that do ("node-2: deadAfter 1s there, 300ms here"); empty
    /// when all agree (`model::cluster_settings`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settings_mismatch: Vec<String>,
    /// This node's BGP speaker (`announce: bgp`), as FRR reports it; None
    /// while the agent drives no FRR.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bgp: Option<BgpStatus>,
}

/// This node's FRR as the agent last saw it (read every 5 s).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BgpStatus {
    /// VIPs in the configuration FRR was last given.
    pub routes: usize,
    pub sessions: Vec<BgpSessionStatus>,
    /// The last failed reload (FRR down, a refused line), cleared by the next
    /// that works; retried every 5 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reload_error: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BgpSessionStatus {
    pub peer: IpAddr,
    /// BGP's state (Established, Active, Connect, ...).
    pub state: String,
    pub prefixes_sent: u64,
    pub prefixes_received: u64,
    /// Why the session last went down, as FRR says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_reset: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ConfigStatus {
    pub path: PathBuf,
    /// Valid configs applied since start.
    pub generation: u64,
    /// The last rejected file's error, cleared by the next valid one.
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ServiceStatus {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: String,
    /// Backend nodes in the ring now (candidates that are healthy, with a known MAC;
    /// when failing open, the unhealthy ones).
    pub backends: Vec<String>,
    /// Backend nodes out of the ring whose established flows still go to them:
    /// their health check failed while their agent runs (or is away, not gone).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub draining: Vec<String>,
    /// Its health check (`HealthStatus::check`), if any.
    pub check: Option<String>,
    /// Every backend's check is down and the service fails open: `backends` are
    /// those unhealthy nodes (the pool's `noHealthyBackend: FailOpen`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub failing_open: bool,
}

/// A service-port that is not in the data path.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct UnprogrammedStatus {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: String,
    pub error: String,
}

/// A node as a backend: its address and the MAC we forward to.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    pub addr: IpAddr,
    /// None: not resolved yet (the node is in no ring until it is).
    pub mac: Option<String>,
    /// The release of the node's agent: this one's, a peer's as its heartbeats
    /// said; None for a peer not heard yet or of a release that does not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// One probe target: a node under one health check. Services sharing a check share
/// the row, so the status grows with nodes × checks, not nodes × services.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HealthStatus {
    pub node: String,
    pub check: String,
    pub healthy: bool,
    pub detail: String,
}

/// A short name of a check: `tcp:80`, `http:80/healthz`.
pub fn check_label(h: &HealthCheck) -> String {
    match &h.probe {
        Probe::Tcp { port } => format!("tcp:{port}"),
        Probe::Http { port, path } => format!("http:{port}{path}"),
    }
}

/// Write to a temporary file and rename, so readers never see half a status.
pub fn write_atomic(path: &std::path::Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Now, in milliseconds since the Unix epoch (the status's timestamps).
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How often the agent rewrites its status when nothing changes; `inspect`
/// calls a status stale after a few of these.
pub const REFRESH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
