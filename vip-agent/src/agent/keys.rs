//! The heartbeat keys: read at start from the key file or the Secret (created
//! when absent), and where their rotations come from while the agent runs.
use std::path::PathBuf;

use anyhow::{bail, Context as _, Result};
use tokio::sync::watch;
use tracing::{info, warn};

use super::HeartbeatKey;
use crate::ha;

/// The key text now (None: a trusted segment, unsigned heartbeats), and where
/// its changes come from. A Secret needs the Kubernetes source's client (`api`:
/// with the agent's namespace).
pub(super) async fn start(key: HeartbeatKey, api: Option<&(kube::Client, String)>) -> Result<(Option<ha::auth::KeyText>, KeyUpdates)> {
    Ok(match key {
        HeartbeatKey::File(path) => {
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading the heartbeat key file {}", path.display()))?;
            let keys = ha::auth::KeyText::new(text).with_context(|| format!("heartbeat key file {}", path.display()))?;
            (Some(keys), KeyUpdates::File(path))
        }
        HeartbeatKey::Secret(name) => {
            let Some((client, ns)) = api.cloned() else { bail!("a heartbeat key Secret needs the Kubernetes source (--kubernetes)") };
            let text = crate::k8s::heartbeat_key::ensure(&client, &ns, &name).await?;
            let keys = ha::auth::KeyText::new(text.clone()).with_context(|| format!("the heartbeat key Secret {ns}/{name}"))?;
            info!(secret = %format!("{ns}/{name}"), "heartbeat keys read from the Secret");
            (Some(keys), KeyUpdates::Secret(crate::k8s::heartbeat_key::watch_keys(client, ns, name, text)))
        }
        HeartbeatKey::Trusted => {
            warn!("heartbeats are not authenticated (--trusted-segment): anyone on the segment can forge them");
            (None, KeyUpdates::None)
        }
    })
}

/// Where new heartbeat key text comes from while the agent runs.
pub(super) enum KeyUpdates {
    /// Re-read on every tick (a mounted Secret is updated in place).
    File(PathBuf),
    /// The watched Secret's key text.
    Secret(watch::Receiver<String>),
    None,
}

impl KeyUpdates {
    /// The next key text to consider; pending forever when there is none.
    pub async fn next(&mut self, tick: &mut tokio::time::Interval) -> Option<String> {
        match self {
            KeyUpdates::File(path) => {
                tick.tick().await;
                match std::fs::read_to_string(&*path) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        warn!("reading the heartbeat key file {}: {e}; keeping the keys read before", path.display());
                        None
                    }
                }
            }
            KeyUpdates::Secret(rx) => match rx.changed().await {
                Ok(()) => Some(rx.borrow_and_update().clone()),
                Err(_) => std::future::pending().await,
            },
            KeyUpdates::None => std::future::pending().await,
        }
    }

    pub fn origin(&self) -> String {
        match self {
            KeyUpdates::File(p) => format!("the key file {}", p.display()),
            KeyUpdates::Secret(_) => "the heartbeat key Secret".to_owned(),
            KeyUpdates::None => String::new(),
        }
    }
}
