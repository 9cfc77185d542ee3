//! The Kubernetes source: the VipPool resource, the Kubernetes objects turned into
//! the same model as the file (`source`), and the elected controller that allocates
//! addresses and writes statuses (`leader`, `controller`, `allocate`, `pools`).
pub mod allocate;
pub mod controller;
pub mod crd;
pub mod leader;
pub mod pools;
pub mod source;

use anyhow::{Context as _, Result};
use futures::StreamExt;
use kube::{
    api::Api,
    runtime::{
        reflector::{self, Store},
        watcher, WatchStreamExt,
    },
    Resource,
};
use tokio::sync::mpsc;
use tracing::warn;

/// A reflector store's objects, owned (the pure functions take slices).
pub(crate) fn owned<K: Clone>(v: Vec<std::sync::Arc<K>>) -> Vec<K> {
    v.into_iter().map(|x| (*x).clone()).collect()
}

/// A client from `kubeconfig`, else in-cluster config or $KUBECONFIG.
pub async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default()).await.with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context("no Kubernetes config: not in a cluster, and no KUBECONFIG")?,
    };
    Ok(kube::Client::try_from(config)?)
}

/// Watches `api` into a store; every change pings `changed`.
pub(crate) fn reflect<K>(api: Api<K>, changed: mpsc::UnboundedSender<()>) -> Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default()).default_backoff().reflect(writer);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            match ev {
                Ok(_) => {
                    if changed.send(()).is_err() {
                        return;
                    }
                }
                Err(e) => warn!("watch: {e}"),
            }
        }
    });
    reader
}
