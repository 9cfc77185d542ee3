//! The agent's pod as deploy/20-daemonset.yaml runs it: its arguments, where the
//! kubelet probes it, and what it tolerates. Labs that stand in for a cluster run
//! the agents with these arguments and probe them as a kubelet would, so that a
//! change to the DaemonSet is what the tests run.
use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{bail, Context as _, Result};
use serde_json::Value;

use crate::{cluster::http_get, kubeapi::deploy_dir, netns::NetNs};

/// An `httpGet` probe and when the kubelet runs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    pub path: String,
    pub port: u16,
    /// `initialDelaySeconds`: the first probe this long after the container starts.
    pub initial_delay: Duration,
    /// `periodSeconds` (default 10).
    pub period: Duration,
}

/// The agent container of deploy/20-daemonset.yaml.
#[derive(Clone, Debug)]
pub struct AgentPod {
    pub args: Vec<String>,
    pub readiness: Probe,
    pub liveness: Probe,
    pub host_network: bool,
    pub tolerations: Vec<Value>,
    /// The pod's `affinity`, if any (null: scheduled on every node it tolerates).
    pub affinity: Value,
    /// `terminationGracePeriodSeconds` (default 30): SIGTERM, then SIGKILL after it.
    pub grace: Duration,
    /// The rolling update's `maxUnavailable` (default 1; a number, not a percentage).
    pub max_unavailable: usize,
}

impl AgentPod {
    pub fn load() -> Result<Self> {
        let path = deploy_dir().join("20-daemonset.yaml");
        let docs = crate::kubeapi::manifests(&path)?;
        let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").context("no DaemonSet in deploy/20-daemonset.yaml")?;
        let pod = &ds["spec"]["template"]["spec"];
        let c = pod["containers"].as_array().and_then(|c| c.iter().find(|c| c["name"] == "agent")).context("no container `agent`")?;
        let probe = |which: &str| -> Result<Probe> {
            let g = &c[which]["httpGet"];
            Ok(Probe {
                path: g["path"].as_str().with_context(|| format!("{which}: no httpGet.path"))?.to_owned(),
                port: g["port"].as_u64().and_then(|p| u16::try_from(p).ok()).with_context(|| format!("{which}: no numeric httpGet.port"))?,
                initial_delay: seconds(&c[which]["initialDelaySeconds"], 0),
                period: seconds(&c[which]["periodSeconds"], 10),
            })
        };
        let args = c["args"]
            .as_array()
            .context("no args")?
            .iter()
            .map(|a| a.as_str().map(str::to_owned).context("an arg that is not a string"))
            .collect::<Result<_>>()?;
        Ok(Self {
            args,
            readiness: probe("readinessProbe")?,
            liveness: probe("livenessProbe")?,
            host_network: pod["hostNetwork"] == true,
            tolerations: pod["tolerations"].as_array().cloned().unwrap_or_default(),
            affinity: pod["affinity"].clone(),
            grace: seconds(&pod["terminationGracePeriodSeconds"], 30),
            max_unavailable: match &ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] {
                Value::Null => 1,
                v => v.as_u64().and_then(|n| usize::try_from(n).ok()).context("updateStrategy.rollingUpdate.maxUnavailable: a number")?,
            },
        })
    }

    /// The value of `--flag` in the arguments.
    pub fn arg(&self, flag: &str) -> Option<&str> {
        self.args.iter().position(|a| a == flag).and_then(|i| self.args.get(i + 1)).map(String::as_str)
    }

    /// Whether the pod is scheduled on a node with this taint (`key`, `effect`).
    pub fn tolerates(&self, key: &str, effect: &str) -> bool {
        self.tolerations.iter().any(|t| {
            let key_ok = (t["key"].is_null() && t["operator"] == "Exists") || t["key"] == key;
            key_ok && (t["effect"].is_null() || t["effect"] == effect)
        })
    }
}

/// A field in seconds, `default` when absent.
fn seconds(v: &Value, default: u64) -> Duration {
    Duration::from_secs(v.as_u64().unwrap_or(default))
}

/// What the kubelet's probe of a host-network pod on a node whose primary
/// InternalIP is `node_ip` gets: it connects to the pod IP, which is that address.
pub fn kubelet_probe(ns: &NetNs, node_ip: IpAddr, p: &Probe) -> Result<(u16, String)> {
    http_get(ns, SocketAddr::new(node_ip, p.port), &p.path)
}

/// Both probes of the pod on a node answer 200 (Ready, and not restarted); the
/// readiness body.
pub fn pod_ready(ns: &NetNs, node_ip: IpAddr, pod: &AgentPod) -> Result<String> {
    let live = kubelet_probe(ns, node_ip, &pod.liveness)?;
    let ready = kubelet_probe(ns, node_ip, &pod.readiness)?;
    if live.0 != 200 || ready.0 != 200 {
        bail!("probes of the pod at {node_ip}: liveness {} {:?}, readiness {} {:?}", live.0, live.1.trim(), ready.0, ready.1.trim());
    }
    Ok(ready.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemonset_reads_as_the_labs_use_it() {
        let pod = AgentPod::load().unwrap();
        assert!(pod.host_network, "the labs probe the node's address: hostNetwork");
        assert_eq!(pod.arg("--metrics-addr").map(|a| a.parse::<SocketAddr>().map(|s| s.port())), Some(Ok(pod.readiness.port)));
        assert!(pod.tolerates("node-role.kubernetes.io/control-plane", "NoSchedule"));
    }
}
