//! The cluster's heartbeat key in Kubernetes: a Secret in the agent's namespace
//! (`vip-heartbeat`, data key `key`: one key per line, the first signs), created by
//! the first agent that finds it absent, as MetalLB creates its memberlist Secret,
//! so that installing takes no manual step. Every agent then watches that one
//! Secret by name (RBAC: a Role in vip's namespace, `resourceNames` on everything
//! but `create`) and takes a rotation within a watch event.
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _, Result};
use futures::StreamExt;
use k8s_openapi::{api::core::v1::Secret, ByteString};
use kube::{
    api::{Api, PostParams},
    runtime::watcher,
};
use tokio::sync::watch;
use tracing::{info, warn};

/// The data key holding the key lines.
pub const DATA_KEY: &str = "key";
/// How long the start waits for a Secret it can use (the API may still be starting).
const ENSURE_LIMIT: Duration = Duration::from_secs(60);

/// A new key line: 32 random bytes, hex (64 characters: more than the 32 bytes a
/// key needs, and text that survives copying between files and Secrets).
pub fn new_key_line() -> Result<String> {
    use ring::rand::SecureRandom as _;
    let mut bytes = [0u8; 32];
    ring::rand::SystemRandom::new().fill(&mut bytes).map_err(|_| anyhow!("no randomness from the system"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// The key text of `secret`, if it has one.
fn key_text(secret: &Secret) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(DATA_KEY)?;
    Some(String::from_utf8_lossy(&bytes.0).into_owned())
}

/// The key text of `ns/name`, creating the Secret with a new random key when it
/// does not exist (a concurrent creator wins: its key is read back). Retries
/// errors for up to a minute, then fails naming what went wrong.
pub async fn ensure(client: &kube::Client, ns: &str, name: &str) -> Result<String> {
    let api: Api<Secret> = Api::namespaced(client.clone(), ns);
    let deadline = tokio::time::Instant::now() + ENSURE_LIMIT;
    loop {
        let err = match try_ensure(&api, name).await {
            Ok(text) => return Ok(text),
            Err(e) => e,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(err.context(format!(
                "the heartbeat key Secret {ns}/{name}: the agent reads it (and creates it when absent) with the Role in deploy/10-rbac.yaml"
            )));
        }
        warn!("heartbeat key Secret {ns}/{name}: {err:#}; retrying");
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

async fn try_ensure(api: &Api<Secret>, name: &str) -> Result<String> {
    if let Some(s) = api.get_opt(name).await.context("reading")? {
        return key_text(&s).ok_or_else(|| anyhow!("it has no data key {DATA_KEY:?} (one heartbeat key per line)"));
    }
    let mut secret = Secret::default();
    secret.metadata.name = Some(name.to_owned());
    secret.metadata.labels = Some([("app.kubernetes.io/name".to_owned(), "vip".to_owned())].into());
    secret.type_ = Some("Opaque".to_owned());
    secret.data = Some([(DATA_KEY.to_owned(), ByteString(format!("{}\n", new_key_line()?).into_bytes()))].into());
    match api.create(&PostParams::default(), &secret).await {
        Ok(s) => {
            info!(secret = name, "created the cluster's heartbeat key Secret (none existed)");
            key_text(&s).ok_or_else(|| anyhow!("the created Secret has no key"))
        }
        // Another agent created it first: take its key.
        Err(kube::Error::Api(e)) if e.code == 409 => match api.get_opt(name).await.context("reading after a concurrent create")? {
            Some(s) => key_text(&s).ok_or_else(|| anyhow!("it has no data key {DATA_KEY:?}")),
            None => bail!("created by another agent and deleted again"),
        },
        Err(e) => Err(anyhow::Error::new(e).context("creating")),
    }
}

/// Watches `ns/name` and sends its key text whenever it changes (a rotation).
/// A deleted Secret keeps the last keys (the next agent start creates a new one).
pub fn watch_keys(client: kube::Client, ns: String, name: String, initial: String) -> watch::Receiver<String> {
    let (tx, rx) = watch::channel(initial);
    let api: Api<Secret> = Api::namespaced(client, &ns);
    let cfg = watcher::Config::default().fields(&format!("metadata.name={name}"));
    tokio::spawn(async move {
        let mut events = std::pin::pin!(watcher(api, cfg));
        while let Some(ev) = events.next().await {
            let secret = match ev {
                Ok(watcher::Event::Apply(s) | watcher::Event::InitApply(s)) => s,
                Ok(watcher::Event::Delete(_)) => {
                    warn!("the heartbeat key Secret {ns}/{name} was deleted; keeping the keys read before");
                    continue;
                }
                Ok(_) => continue,
                Err(e) => {
                    warn!("watching the heartbeat key Secret {ns}/{name}: {e}");
                    continue;
                }
            };
            match key_text(&secret) {
                Some(text) => {
                    tx.send_if_modified(|cur| {
                        let changed = *cur != text;
                        *cur = text;
                        changed
                    });
                }
                None => warn!("the heartbeat key Secret {ns}/{name} has no data key {DATA_KEY:?}; keeping the keys read before"),
            }
            if tx.is_closed() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_keys_are_long_enough_and_differ() {
        let a = new_key_line().unwrap();
        let b = new_key_line().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.len() >= crate::ha::auth::MIN_KEY_LEN);
        assert_ne!(a, b);
        crate::ha::auth::Keys::from_text(&a).unwrap();
    }
}
