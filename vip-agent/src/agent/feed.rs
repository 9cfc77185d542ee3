//! Where models come from: the YAML file (read at start, re-read when it changes
//! or on SIGHUP) or the Kubernetes watches, as one stream of new models.
use std::{
    collections::BTreeMap,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::Agent;
use crate::{
    config,
    ha::HeldVip,
    metrics,
    model::{Announce, Failover, NoHolder, World},
    preflight,
};

/// Where the model comes from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A YAML file, re-read on change and on SIGHUP.
    File(PathBuf),
    /// The Kubernetes API (in-cluster config or KUBECONFIG): Nodes, VipPools,
    /// Services, EndpointSlices. The agent also takes part in the Lease election in
    /// `lease_namespace`; the leader allocates addresses and writes statuses.
    /// The cluster objects carry no timers: `announce` and `failover` (flags) do.
    /// The start gives up after `sync_timeout` without the first list of a watch.
    Kubernetes { lease_namespace: String, kubeconfig: Option<PathBuf>, announce: Announce, failover: Failover, sync_timeout: Duration },
}

impl Source {
    /// The metrics of this source's mode (some exist in one mode only).
    pub fn mode(&self) -> metrics::Mode {
        match self {
            Source::File(_) => metrics::Mode::File,
            Source::Kubernetes { .. } => metrics::Mode::Kubernetes,
        }
    }
}

/// The source, started: what feeds the loop new models, the file (polled) or
/// the Kubernetes watches. What differs between the sources is answered here.
pub(super) enum Feed {
    File(PathBuf),
    Kubernetes(watch::Receiver<World>),
}

impl Feed {
    /// The config file, re-read on change and SIGHUP.
    pub fn file(&self) -> Option<&Path> {
        match self {
            Feed::File(path) => Some(path),
            Feed::Kubernetes(_) => None,
        }
    }

    /// How VIP traffic is taken in on this node's backends.
    pub fn intake(&self) -> preflight::Intake {
        match self {
            Feed::File(_) => preflight::Intake::VipOnLo,
            Feed::Kubernetes(_) => preflight::Intake::KubeProxy,
        }
    }

    /// Where the model comes from, as the status names it.
    pub fn origin(&self) -> PathBuf {
        self.file().map_or_else(|| PathBuf::from("kubernetes"), Path::to_path_buf)
    }
}

/// What the agent tells the elected controller and the VipStatus writer (the
/// Kubernetes source's tasks); unused with the file.
pub(super) struct ControllerInputs {
    pub owners: watch::Receiver<BTreeMap<IpAddr, String>>,
    pub unprogrammed: watch::Receiver<BTreeMap<IpAddr, Vec<String>>>,
    pub unheld: watch::Receiver<BTreeMap<IpAddr, NoHolder>>,
    pub held_vips: watch::Receiver<BTreeMap<IpAddr, HeldVip>>,
    pub backends: watch::Receiver<BTreeMap<IpAddr, Vec<String>>>,
}

/// The source started: its first model, the file's text, and the client
/// (with the Lease namespace) where it is the Kubernetes API.
pub(super) struct Started {
    pub world: World,
    pub text: Option<String>,
    pub feed: Feed,
    pub api: Option<(kube::Client, String)>,
}

/// Reads the file, or starts the watches with the Lease election, the elected
/// controller and the VipStatus writer, which register their metrics.
pub(super) async fn start(source: Source, me: &str, metrics: &mut metrics::Metrics, to_controller: ControllerInputs) -> Result<Started> {
    match source {
        Source::File(path) => {
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let world = config::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            if world.node(me).is_none() {
                bail!("{}: nodes: this node ({me:?}) is not listed; set --node-name to one of the listed names", path.display());
            }
            Ok(Started { world, text: Some(text), feed: Feed::File(path), api: None })
        }
        Source::Kubernetes { lease_namespace, kubeconfig, announce, failover, sync_timeout } => {
            let client = crate::k8s::kube_client(kubeconfig.as_deref()).await?;
            info!("watching Nodes, VipPools, Services and EndpointSlices");
            let base = World { announce, failover, ..World::default() };
            let rx = crate::k8s::source::watch_world(client.clone(), base, sync_timeout).await?;
            let world = rx.borrow().clone();
            let leading = crate::k8s::leader::spawn(client.clone(), crate::k8s::leader::LeaderConfig::new(&lease_namespace, me));
            let ControllerInputs { owners, unprogrammed, unheld, held_vips, backends } = to_controller;
            let view =
                crate::k8s::controller::AgentView { owners, pool_addresses: Some(crate::k8s::register_metrics(&mut metrics.registry)), unprogrammed, unheld };
            tokio::spawn(crate::k8s::controller::run(client.clone(), me.to_owned(), leading, Duration::from_secs(30), view));
            tokio::spawn(crate::k8s::vipstatus::run_holder(client.clone(), me.to_owned(), held_vips, backends));
            Ok(Started { world, text: None, feed: Feed::Kubernetes(rx), api: Some((client, lease_namespace)) })
        }
    }
}

/// The next model from the Kubernetes watches (pending forever with the file source).
pub(super) async fn next_world(feed: &mut Feed) -> Option<World> {
    match feed {
        Feed::Kubernetes(rx) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        Feed::File(_) => std::future::pending().await,
    }
}

impl Agent {
    /// Re-reads the config file when it changed (or when `force`d by SIGHUP) and
    /// applies it when valid.
    pub(super) fn reload(&mut self, force: bool) {
        let Some(path) = self.config_file.clone() else { return };
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                self.reject(format!("cannot read {}: {e}", path.display()));
                return;
            }
        };
        if !force && self.config_text.as_deref() == Some(text.as_str()) {
            return;
        }
        self.config_text = Some(text.clone());
        let world = match config::parse(&text) {
            Ok(w) => w,
            Err(e) => {
                self.reject(e.to_string());
                return;
            }
        };
        for w in config::warnings(&world) {
            warn!("{w}");
        }
        info!(path = %self.status.config.path.display(), "config changed; applying");
        self.status.config.generation += 1;
        self.status.config.error = None;
        if world.node(&self.me).is_none() {
            // Applied all the same: a node removed from the model must stop holding
            // VIPs, not keep the last model and answer beside their new owners.
            warn!(node = %self.me, "nodes: this node is not listed any more: it holds no VIP until it is");
            self.status.config.error = Some(format!("nodes: this node ({:?}) is not listed: it holds no VIP", self.me));
        }
        self.metrics.config_valid.set(1);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "ok".into() }).inc();
        self.adopt(Arc::new(world));
        self.reconcile(None);
    }

    pub(super) fn reject(&mut self, msg: String) {
        error!(path = %self.status.config.path.display(), error = %msg, "config rejected; the last good config keeps running");
        self.status.config.error = Some(msg);
        self.metrics.config_valid.set(0);
        self.metrics.config_reloads.get_or_create(&metrics::ResultLabels { result: "error".into() }).inc();
        self.publish();
    }
}
