//! Where models come from: the YAML file (read at start, re-read when it changes
//! or on SIGHUP) or the Kubernetes watches, as one stream of new models.
use std::{path::PathBuf, sync::Arc, time::Duration};

use tokio::sync::watch;
use tracing::{error, info, warn};

use super::Agent;
use crate::metrics;
use crate::{
    config,
    model::{Announce, Failover, World},
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

/// What feeds the loop new models: the file (polled) or the Kubernetes watches.
pub(super) enum Feed {
    File,
    Kubernetes(watch::Receiver<World>),
}

/// The next model from the Kubernetes watches (pending forever with the file source).
pub(super) async fn next_world(feed: &mut Feed) -> Option<World> {
    match feed {
        Feed::Kubernetes(rx) => match rx.changed().await {
            Ok(()) => Some(rx.borrow_and_update().clone()),
            Err(_) => std::future::pending().await,
        },
        Feed::File => std::future::pending().await,
    }
}

impl Agent {
    /// Re-reads the config file when it changed (or when `force`d by SIGHUP) and
    /// applies it when valid.
    pub(super) fn reload(&mut self, force: bool) {
        let Source::File(path) = &self.opts.source else { return };
        let text = match std::fs::read_to_string(path) {
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
        if world.node(&self.opts.node_name).is_none() {
            // Applied all the same: a node removed from the model must stop holding
            // VIPs, not keep the last model and answer beside their new owners.
            warn!(node = %self.opts.node_name, "nodes: this node is not listed any more: it holds no VIP until it is");
            self.status.config.error = Some(format!("nodes: this node ({:?}) is not listed: it holds no VIP", self.opts.node_name));
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
