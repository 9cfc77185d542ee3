//! `vip-agent`'s command line (clap). In the library so that the reference
//! (docs/reference/cli.md, `cargo xtask docs`) is generated from the same
//! definitions the binary parses.
use std::{path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::{
    dataplane::{self, AttachMode},
    ha::garp::ArpSender,
    model::{Announce, Failover},
};

/// Where `run` writes its status and `inspect` reads it.
pub const DEFAULT_STATUS_FILE: &str = "/run/vip/status.json";

#[derive(Parser, Debug)]
#[command(
    name = "vip-agent",
    version,
    about = "vip: bare-metal virtual IP load balancer, node agent",
    long_about = "vip: bare-metal virtual IP load balancer, node agent.\n\n\
                  Runs on every node that holds VIPs or is a backend: answers ARP for the VIPs the node holds \
                  (XDP) and spreads their traffic over the ready backend nodes (Maglev). The model comes from a \
                  YAML file (`run --config`) or from the Kubernetes API (`run --kubernetes`).",
    after_help = "Every flag of `run` can also be set by the environment variable shown with it.\n\
                  Check a file and this host before running: `vip-agent check --config FILE --node-name NAME`.\n\
                  Look at a running node: `vip-agent inspect`."
)]
pub struct Cli {
    /// The bpffs directory holding the pinned program, links and maps (the data
    /// path's state, which outlives the agent process).
    #[arg(long, global = true, env = "VIP_PIN_DIR", default_value = dataplane::DEFAULT_PIN_DIR)]
    pub pin_dir: PathBuf,
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Run the node agent: keep this node's data path equal to the model, taken
    /// from a YAML file (`--config`) or from the Kubernetes API (`--kubernetes`).
    ///
    /// With `--config` the file is re-read when it changes and on SIGHUP (a rejected
    /// file leaves the last good one running). With `--kubernetes` the model comes
    /// from Nodes, VipPools, Services and EndpointSlices, and one agent, elected
    /// through a Lease, allocates addresses and writes statuses. Stopping the agent
    /// leaves the data path running on its last state until held VIPs expire.
    Run(Box<RunArgs>),
    /// Check a config file without running anything; with `--node-name`, also this
    /// host as that node.
    ///
    /// The host check covers what the node needs for the VIP traffic it backs (each
    /// such VIP an address of `lo`, strict ARP sysctls) and the interface each pool
    /// would be answered on. Exit status: 0 ready, 1 invalid file (or node not
    /// listed), 2 host not ready.
    Check(CheckArgs),
    /// Print the VipPool and VipStatus CustomResourceDefinitions (YAML), as committed in deploy/crd.yaml.
    Crd,
    /// Load the XDP program (re-using pinned maps) and attach it to one interface,
    /// without the agent. `run` attaches by itself; this is for manual set-ups and
    /// tests.
    Attach(AttachArgs),
    /// Detach the XDP program from interfaces; with `--purge`, also remove the
    /// pinned program and maps.
    ///
    /// Needs a target: `--iface IFACE`, `--all`, or `--purge`. Stop the agent first:
    /// a running agent attaches again within 30 s. Says what it removed.
    Detach(DetachArgs),
    /// Remove what vip leaves on this node when uninstalled: detach the program
    /// from every interface, remove the pinned program and maps, vip's addresses on
    /// lo, its routing rules and blackhole routes (table 7473) and the status file.
    ///
    /// The agent must not be running (it would attach again). In Kubernetes,
    /// deploy/cleanup/ runs this on every node.
    Cleanup(CleanupArgs),
    /// Show this node's data path: held VIPs, Services with their backends and
    /// counters, the reasons packets were passed or dropped; with the agent's
    /// status, also VIP owners, backend health and how old that status is.
    ///
    /// Reads the pinned maps (root, or CAP_BPF) and the status file the agent
    /// writes; it changes nothing.
    Inspect(InspectArgs),
    /// Write VipPools equivalent to another load balancer's configuration (YAML
    /// on stdout), to switch to vip without changing any Service's address.
    Import(ImportArgs),
}

/// `vip-agent run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The YAML config file: nodes, pools, services, timers (example:
    /// deploy/file/vip.yaml). Re-read when it changes and on SIGHUP.
    #[arg(long, env = "VIP_CONFIG", required_unless_present = "kubernetes", conflicts_with = "kubernetes")]
    pub config: Option<PathBuf>,
    /// Take the model from the Kubernetes API (Nodes, VipPools, Services,
    /// EndpointSlices) instead of a file: in-cluster config, else $KUBECONFIG.
    // No environment variable: an unset-looking VIP_KUBERNETES=false would still
    // count as given for clap's conflicts; the source is named in the arguments.
    #[arg(long)]
    pub kubernetes: bool,
    /// With --kubernetes: a kubeconfig file (default: the in-cluster config, else $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// With --kubernetes: the namespace of the leader-election Lease (the DaemonSet
    /// sets the pod's own namespace through the downward API).
    #[arg(long, env = "POD_NAMESPACE", default_value = "vip-system")]
    pub lease_namespace: String,
    /// This node's name: one of the config file's `nodes`, or the Kubernetes Node's
    /// name (the DaemonSet sets it from spec.nodeName). Default: the host name.
    #[arg(long, env = "VIP_NODE_NAME")]
    pub node_name: Option<String>,
    /// The network interface of pools that name none (a pool's `interfaces`), and
    /// this node's home: where it is reached, and where frames to backends of VIPs
    /// of other networks leave. The program is attached there.
    ///
    /// Default: each pool on the interface whose network holds its first IPv4
    /// address (else its first IPv6 address), home on the interface holding the
    /// node's address.
    #[arg(long, env = "VIP_IFACE")]
    pub iface: Option<String>,
    /// How the XDP program is attached to each interface.
    #[arg(long, value_enum, env = "VIP_XDP_MODE", default_value = "auto")]
    pub mode: AttachMode,
    /// Slots of the ring map shared by all services' Maglev rings (a service takes
    /// its table size; services with equal rings share one). Only used when the map
    /// is created: on a node's first start, or after `detach --purge`.
    #[arg(long, env = "VIP_RING_CAPACITY", default_value_t = vip_common::DEFAULT_RING_CAPACITY)]
    pub ring_capacity: u32,
    /// Address of the HTTP server for /metrics, /healthz, /readyz and /status:
    /// address:port (`[::]:9472` is every address of both families), or an address
    /// alone for port 9472 (IPv4 or IPv6, as `$(HOST_IP)` gives it); "off" for none.
    #[arg(long, env = "VIP_METRICS_ADDR", default_value = "127.0.0.1:9472")]
    pub metrics_addr: String,
    /// The status JSON, rewritten after every change and every 30 s; `inspect`
    /// reads it for Service names, owners, health and its age.
    #[arg(long, env = "VIP_STATUS_FILE", default_value = DEFAULT_STATUS_FILE)]
    pub status_file: PathBuf,
    /// With --config: how often the file is checked for changes, e.g. 1s, 250ms
    /// (SIGHUP re-reads it at once).
    #[arg(long, env = "VIP_RELOAD_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub reload_interval: Duration,
    /// How gratuitous ARP and ARP requests leave the node.
    #[arg(long, value_enum, env = "VIP_ARP_SENDER", default_value = "auto")]
    pub arp_sender: ArpSender,
    /// How often each VIP another node holds is checked by a peer (the ARP
    /// self-check: the peer asks who answers ARP for it and tells the holder of any
    /// MAC but its own), e.g. 45s; checks are spread over it, at most 5 requests a
    /// second per node (more VIPs are checked less often). 0s: no check.
    #[arg(long, env = "VIP_ARP_CHECK_INTERVAL", default_value = "45s", value_parser = humantime::parse_duration)]
    pub arp_check_interval: Duration,
    /// `announce: bgp`: FRR's integrated configuration file, which the agent
    /// writes (FRR's configuration directory is its directory).
    #[arg(long, env = "VIP_FRR_CONFIG", default_value = "/etc/frr/frr.conf")]
    pub frr_config: PathBuf,
    /// `announce: bgp`: the directory of FRR's vty sockets.
    #[arg(long, env = "VIP_FRR_VTY_DIR", default_value = "/var/run/frr")]
    pub frr_vty_dir: PathBuf,
    /// `announce: bgp`: FRR's frr-reload.py, which applies the difference.
    #[arg(long, env = "VIP_FRR_RELOAD", default_value = "/usr/lib/frr/frr-reload.py")]
    pub frr_reload: PathBuf,
    /// `announce: bgp`: FRR's vtysh.
    #[arg(long, env = "VIP_VTYSH", default_value = "/usr/bin/vtysh")]
    pub vtysh: PathBuf,
    /// Log JSON lines instead of text (the level comes from RUST_LOG, default info).
    #[arg(long, env = "VIP_LOG_JSON", value_parser = clap::builder::BoolishValueParser::new())]
    pub log_json: bool,
    /// The cluster's heartbeat key file: one key per line (at least 32 bytes
    /// each), the first signs, all are accepted (rotation). Re-read every 5 s.
    /// With --kubernetes the default is the Secret of --heartbeat-secret.
    #[arg(long, env = "VIP_HEARTBEAT_KEY_FILE")]
    pub heartbeat_key_file: Option<PathBuf>,
    /// With --kubernetes and no key file: the Secret (in the agent's namespace)
    /// holding the heartbeat keys under `key`; created with a random key when
    /// absent, watched for rotations.
    #[arg(long, env = "VIP_HEARTBEAT_SECRET", default_value = "vip-heartbeat")]
    pub heartbeat_secret: String,
    /// Run without a heartbeat key: heartbeats go unsigned and anyone on the
    /// segment can forge them. Only for a segment you trust.
    #[arg(long, env = "VIP_TRUSTED_SEGMENT", conflicts_with = "heartbeat_key_file", value_parser = clap::builder::BoolishValueParser::new())]
    pub trusted_segment: bool,
    #[command(flatten)]
    pub timers: KubeTimers,
    /// With --kubernetes: how long the start waits for the first list of Nodes,
    /// VipPools, Services and EndpointSlices before it gives up, naming the
    /// missing ones (an uninstalled CRD or missing RBAC never lists).
    #[arg(long, env = "VIP_SYNC_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    pub sync_timeout: Duration,
}

/// Kubernetes mode's failover timers and heartbeat port (a config file has them
/// under `announce` and `failover`, so they conflict with --config). Every agent
/// of a cluster must use the same values.
#[derive(Args, Debug)]
pub struct KubeTimers {
    /// With --kubernetes: the UDP port agents exchange heartbeats on, on the
    /// nodes' addresses (a file's failover.heartbeatPort).
    #[arg(long, env = "VIP_HEARTBEAT_PORT", default_value_t = Failover::default().heartbeat_port, conflicts_with = "config")]
    pub heartbeat_port: u16,
    /// With --kubernetes: how often each agent sends heartbeats (a file's
    /// failover.heartbeatInterval). At least 5ms.
    #[arg(long, env = "VIP_HEARTBEAT_INTERVAL", default_value_t = Failover::default().heartbeat_interval.into(), conflicts_with = "config")]
    pub heartbeat_interval: humantime::Duration,
    /// With --kubernetes: a node not heard from for this long is dead and its VIPs
    /// move, i.e. the failover time (a file's failover.deadAfter). At least 3
    /// heartbeat intervals and 4/3 of --hold-time.
    #[arg(long, env = "VIP_DEAD_AFTER", default_value_t = Failover::default().dead_after.into(), conflicts_with = "config")]
    pub dead_after: humantime::Duration,
    /// With --kubernetes: how long a held VIP is still answered after its holder's
    /// last refresh, so that a hung agent stops answering by itself (a file's
    /// announce.holdTime). At least 100ms.
    #[arg(long, env = "VIP_HOLD_TIME", default_value_t = Announce::default().hold_time.into(), conflicts_with = "config")]
    pub hold_time: humantime::Duration,
}

/// The flags' names of the timers, for errors.
pub const TIMER_FLAGS: crate::config::TimerFields = crate::config::TimerFields {
    hold_time: "--hold-time",
    heartbeat_port: "--heartbeat-port",
    heartbeat_interval: "--heartbeat-interval",
    dead_after: "--dead-after",
};

impl KubeTimers {
    /// The timers as the model holds them, checked with the file's bounds.
    pub fn model(&self) -> anyhow::Result<(Announce, Failover)> {
        let announce = Announce { hold_time: *self.hold_time, ..Announce::default() };
        let failover = Failover { heartbeat_port: self.heartbeat_port, heartbeat_interval: *self.heartbeat_interval, dead_after: *self.dead_after };
        crate::config::check_timers(&announce, &failover, &TIMER_FLAGS).map_err(|e| anyhow::anyhow!("{}: {}", e.path, e.message))?;
        Ok((announce, failover))
    }
}

/// `vip-agent check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The YAML config file to check (as `run --config`).
    #[arg(long, required_unless_present = "file", value_name = "CONFIG")]
    pub config: Option<PathBuf>,
    /// The config file, as a positional argument (the same as --config; kept for
    /// scripts written before --config).
    #[arg(hide = true, conflicts_with = "config", value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Also check this host as that node (one of the file's `nodes`).
    #[arg(long, env = "VIP_NODE_NAME")]
    pub node_name: Option<String>,
    /// As `run --iface`: the interface of pools that name none and this node's
    /// home, whose ARP sysctls are checked (with --node-name). Default: found as
    /// `run` finds it.
    #[arg(long, env = "VIP_IFACE")]
    pub iface: Option<String>,
}

impl CheckArgs {
    /// The file to check (--config, or the positional form).
    pub fn path(&self) -> &std::path::Path {
        self.config.as_deref().or(self.file.as_deref()).expect("clap requires one of them")
    }
}

/// `vip-agent attach`.
#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The interface to attach the program to.
    #[arg(long)]
    pub iface: String,
    /// How the XDP program is attached.
    #[arg(long, value_enum, env = "VIP_XDP_MODE", default_value = "auto")]
    pub mode: AttachMode,
    /// Slots of the ring map shared by all services' rings (as `run --ring-capacity`;
    /// only used when the map is created).
    #[arg(long, env = "VIP_RING_CAPACITY", default_value_t = vip_common::DEFAULT_RING_CAPACITY)]
    pub ring_capacity: u32,
}

/// `vip-agent detach`.
#[derive(Args, Debug)]
pub struct DetachArgs {
    /// The interface to detach the program from.
    #[arg(long, conflicts_with = "all")]
    pub iface: Option<String>,
    /// Detach from every interface the pins show (each link under --pin-dir).
    #[arg(long)]
    pub all: bool,
    /// Also remove the pinned program and every map under --pin-dir: held VIPs,
    /// services, rings and flows are gone; the next start creates them anew.
    #[arg(long)]
    pub purge: bool,
}

/// `vip-agent cleanup`.
#[derive(Args, Debug)]
pub struct CleanupArgs {
    /// The agent's status JSON (`run --status-file`), removed with the rest.
    #[arg(long, env = "VIP_STATUS_FILE", default_value = DEFAULT_STATUS_FILE)]
    pub status_file: PathBuf,
    /// Then wait until terminated (the main container of a DaemonSet: deploy/cleanup/).
    #[arg(long)]
    pub wait: bool,
}

/// `vip-agent inspect`.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Print the report as JSON (with the data path's internal ids) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also show the data path's internal ids (services, backends), fragment
    /// entries and counters that are zero.
    #[arg(long, short)]
    pub verbose: bool,
    /// The agent's status JSON (`run --status-file`).
    #[arg(long, env = "VIP_STATUS_FILE", default_value = DEFAULT_STATUS_FILE)]
    pub status_file: PathBuf,
}

/// `vip-agent import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    #[command(subcommand)]
    pub from: ImportFrom,
}

#[derive(Subcommand, Debug)]
pub enum ImportFrom {
    /// MetalLB's IPAddressPools and L2Advertisements (metallb.io/v1beta1) as
    /// VipPools, from YAML files (`-f`) or from the cluster (`--from-cluster`).
    ///
    /// Each IPAddressPool becomes a VipPool of the same name: its IPv4 and IPv6
    /// addresses, autoAssign, avoidBuggyIPs, serviceAllocation (namespaces,
    /// namespace and service selectors) and the nodeSelectors and interfaces of
    /// the L2Advertisements that select it. A pool hands out exactly the addresses
    /// MetalLB did, so dual-stack Services keep both of theirs: an IPv6 CIDR is
    /// written as the range of all its addresses (MetalLB hands out its first
    /// address, which a VipPool's CIDR leaves out), with a warning. The VipPools go
    /// to stdout; what is not imported as it was (such CIDRs, BGP, priorities,
    /// selectors a VipPool cannot express) is listed on stderr as `# warning:`
    /// lines naming the object and field. Exit status: 0 when the input was read
    /// (warnings or not), 1 when it could not be.
    Metallb(MetallbImportArgs),
}

/// `vip-agent import metallb`.
#[derive(Args, Debug)]
pub struct MetallbImportArgs {
    /// A YAML file of MetalLB objects (several documents, or a `kubectl get -o
    /// yaml` List); `-` reads stdin. Repeat for more files.
    #[arg(short = 'f', long = "filename", value_name = "FILE", required_unless_present = "from_cluster", conflicts_with = "from_cluster")]
    pub files: Vec<PathBuf>,
    /// Read MetalLB's objects from the cluster (every kind of the metallb.io API
    /// group in --namespace) instead of files.
    #[arg(long)]
    pub from_cluster: bool,
    /// With --from-cluster: a kubeconfig file (default: $KUBECONFIG, else the in-cluster config).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// With --from-cluster: the namespace MetalLB reads its configuration from.
    #[arg(long, default_value = "metallb-system")]
    pub namespace: String,
}

/// The port of `--metrics-addr` given as an address alone.
pub const METRICS_PORT: u16 = 9472;

/// `--metrics-addr`: `ADDR:PORT`, `[V6]:PORT`, or an address alone (IPv4, IPv6,
/// bracketed or not) for [`METRICS_PORT`].
pub fn metrics_addr(a: &str) -> anyhow::Result<std::net::SocketAddr> {
    if let Ok(s) = a.parse() {
        return Ok(s);
    }
    let bare = a.strip_prefix('[').and_then(|b| b.strip_suffix(']')).unwrap_or(a);
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok((ip, METRICS_PORT).into()),
        Err(e) => anyhow::bail!("--metrics-addr {a:?}: {e} (an address:port, an address alone for port {METRICS_PORT}, or \"off\")"),
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn metrics_addr_takes_an_address_alone_of_either_family() {
        let ok = |a: &str, want: &str| assert_eq!(metrics_addr(a).unwrap(), want.parse::<std::net::SocketAddr>().unwrap(), "{a}");
        ok("0.0.0.0:9472", "0.0.0.0:9472");
        ok("[::]:9472", "[::]:9472");
        ok("198.18.0.1", "198.18.0.1:9472");
        ok("2001:2::1", "[2001:2::1]:9472");
        ok("[2001:2::1]", "[2001:2::1]:9472");
        ok("[2001:2::1]:80", "[2001:2::1]:80");
        for bad in ["", "node-1", "198.18.0.1:", "[2001:2::1", "198.18.0.1:99999"] {
            let e = metrics_addr(bad).unwrap_err().to_string();
            assert!(e.contains("--metrics-addr") && e.contains("address alone"), "{bad}: {e}");
        }
    }

    #[test]
    fn the_definitions_are_consistent() {
        Cli::command().debug_assert();
    }

    /// Every flag and subcommand says what it is for (the reference is made of these).
    #[test]
    fn every_flag_and_subcommand_has_help() {
        fn walk(c: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for a in c.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = a.get_id().as_str();
                if id != "help" && id != "version" && a.get_help().is_none() {
                    missing.push(format!("{path} {id}"));
                }
            }
            for s in c.get_subcommands().filter(|s| s.get_name() != "help") {
                if s.get_about().is_none() {
                    missing.push(format!("{path} {}", s.get_name()));
                }
                walk(s, &format!("{path} {}", s.get_name()), missing);
            }
        }
        let mut missing = Vec::new();
        walk(&Cli::command(), "vip-agent", &mut missing);
        assert!(missing.is_empty(), "no help text: {missing:?}");
    }

    /// Every flag of `run` but the source switch (`--kubernetes`, always in the
    /// arguments) can come from the environment (a DaemonSet's `env:`).
    #[test]
    fn every_run_flag_has_an_environment_variable() {
        let cmd = Cli::command();
        let run = cmd.find_subcommand("run").unwrap();
        let without: Vec<&str> =
            run.get_arguments().filter(|a| a.get_long().is_some() && a.get_env().is_none()).map(|a| a.get_id().as_str()).filter(|id| *id != "help").collect();
        assert_eq!(without, ["kubernetes"], "run flags without an environment variable");
    }

    #[test]
    fn kubernetes_timers_default_to_the_models_and_keep_its_bounds() {
        let run = |args: &[&str]| match Cli::try_parse_from([&["vip-agent", "run", "--kubernetes"], args].concat()).unwrap().cmd {
            Cmd::Run(r) => r,
            _ => unreachable!(),
        };
        let (a, f) = run(&[]).timers.model().unwrap();
        assert_eq!((a, f), (Announce::default(), Failover::default()));
        let (a, f) = run(&["--hold-time", "1s", "--dead-after", "2s", "--heartbeat-interval", "100ms", "--heartbeat-port", "7000"]).timers.model().unwrap();
        assert_eq!(
            (a.hold_time, f.dead_after, f.heartbeat_interval, f.heartbeat_port),
            (Duration::from_secs(1), Duration::from_secs(2), Duration::from_millis(100), 7000)
        );
        let e = run(&["--hold-time", "1s"]).timers.model().unwrap_err().to_string();
        assert!(e.contains("--dead-after: must be at least --hold-time × 4/3 (1.333333333s)"), "{e}");
        let e = run(&["--heartbeat-interval", "1ms"]).timers.model().unwrap_err().to_string();
        assert!(e.contains("--heartbeat-interval: must be at least 5ms"), "{e}");
        // The file has them: the flags are refused beside --config.
        let e = Cli::try_parse_from(["vip-agent", "run", "--config", "x.yaml", "--dead-after", "1s"]).unwrap_err().to_string();
        assert!(e.contains("--dead-after") && e.contains("cannot be used with"), "{e}");
    }

    #[test]
    fn import_metallb_takes_files_or_the_cluster() {
        let parse = |args: &[&str]| match Cli::try_parse_from([&["vip-agent", "import", "metallb"], args].concat()).map(|c| c.cmd) {
            Ok(Cmd::Import(ImportArgs { from: ImportFrom::Metallb(m) })) => Ok(m),
            Ok(_) => unreachable!(),
            Err(e) => Err(e.to_string()),
        };
        let m = parse(&["-f", "a.yaml", "--filename", "-"]).unwrap();
        assert_eq!((m.files, m.from_cluster, m.namespace.as_str()), (vec![PathBuf::from("a.yaml"), PathBuf::from("-")], false, "metallb-system"));
        let m = parse(&["--from-cluster", "--namespace", "lb"]).unwrap();
        assert!(m.files.is_empty() && m.from_cluster && m.namespace == "lb");
        assert!(parse(&[]).unwrap_err().contains("--filename"));
        assert!(parse(&["-f", "a.yaml", "--from-cluster"]).unwrap_err().contains("cannot be used with"));
    }

    #[test]
    fn check_takes_its_file_as_config_or_positional() {
        let path = |args: &[&str]| match Cli::try_parse_from([&["vip-agent", "check"], args].concat()).map(|c| c.cmd) {
            Ok(Cmd::Check(c)) => Ok(c.path().to_owned()),
            Ok(_) => unreachable!(),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(path(&["--config", "a.yaml"]), Ok("a.yaml".into()));
        assert_eq!(path(&["a.yaml"]), Ok("a.yaml".into()));
        assert!(path(&[]).unwrap_err().contains("--config"));
        assert!(path(&["--config", "a.yaml", "b.yaml"]).is_err());
    }
}
