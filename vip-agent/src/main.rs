use std::{net::SocketAddr, path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use vip_agent::{
    agent,
    dataplane::{self, AttachMode, Dataplane},
    inspect, preflight,
};

#[derive(Parser)]
#[command(
    name = "vip-agent",
    version,
    about = "vip: bare-metal virtual IP load balancer, node agent",
    after_help = "The config file format, an example (deploy/file/vip.yaml), a systemd unit (deploy/file/vip-agent.service) and \
                  what each node needs: README, \"Run it on your machines\". Check a file and a host with `vip-agent check FILE --node-name NAME`."
)]
struct Cli {
    /// bpffs directory holding the pinned program, links and maps.
    #[arg(long, global = true, env = "VIP_PIN_DIR", default_value = dataplane::DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the node agent from a YAML config file (re-read on change and on SIGHUP).
    Run {
        /// The YAML model of the world (nodes, pools, services).
        #[arg(long, env = "VIP_CONFIG", required_unless_present = "kubernetes", conflicts_with = "kubernetes")]
        config: Option<PathBuf>,
        /// Take the model from the Kubernetes API instead (in-cluster config or KUBECONFIG).
        #[arg(long)]
        kubernetes: bool,
        /// With --kubernetes: a kubeconfig file (default: in-cluster config, else $KUBECONFIG).
        #[arg(long, env = "KUBECONFIG")]
        kubeconfig: Option<PathBuf>,
        /// Namespace of the leader-election Lease (the agent's own, from the downward API).
        #[arg(long, env = "POD_NAMESPACE", default_value = "vip-system")]
        lease_namespace: String,
        /// This node's name in the config's `nodes` (default: the host name).
        #[arg(long, env = "VIP_NODE_NAME")]
        node_name: Option<String>,
        /// The interface of pools that name none (`interfaces:` in a pool), and where
        /// this node is reached. Default: each pool on the interface whose network
        /// holds its addresses, else the one holding the node's address.
        #[arg(long, env = "VIP_IFACE")]
        iface: Option<String>,
        #[arg(long, value_enum, default_value = "auto")]
        mode: AttachMode,
        /// Slots in lb4_ring shared by all services' rings (only used when the map is created).
        #[arg(long, default_value_t = vip_common::DEFAULT_RING_CAPACITY)]
        ring_capacity: u32,
        /// Address for /metrics, /healthz, /readyz and /status; "off" for none.
        #[arg(long, env = "VIP_METRICS_ADDR", default_value = "127.0.0.1:9472")]
        metrics_addr: String,
        /// Status JSON written after every change (read by `inspect`).
        #[arg(long, env = "VIP_STATUS_FILE", default_value = "/run/vip/status.json")]
        status_file: PathBuf,
        /// How often the config file is checked for changes, e.g. 1s, 250ms.
        #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
        reload_interval: Duration,
        /// How gratuitous ARP and ARP requests leave: `xdp` (through the XDP
        /// program; needs no CAP_NET_RAW, needs a native attachment), `packet` (a
        /// packet socket; CAP_NET_RAW), `auto` (xdp where attached natively).
        #[arg(long, value_enum, env = "VIP_ARP_SENDER", default_value = "auto")]
        arp_sender: vip_agent::ha::garp::ArpSender,
        /// Log as JSON lines instead of text.
        #[arg(long)]
        log_json: bool,
        /// The cluster's heartbeat key file: one key per line (at least 32 bytes
        /// each), the first signs, all are accepted (rotation). Re-read every 5 s.
        /// With --kubernetes the default is the Secret of --heartbeat-secret.
        #[arg(long, env = "VIP_HEARTBEAT_KEY_FILE")]
        heartbeat_key_file: Option<PathBuf>,
        /// With --kubernetes and no key file: the Secret (in the agent's namespace)
        /// holding the heartbeat keys under `key`; created with a random key when
        /// absent, watched for rotations.
        #[arg(long, env = "VIP_HEARTBEAT_SECRET", default_value = "vip-heartbeat")]
        heartbeat_secret: String,
        /// Run without a heartbeat key: heartbeats go unsigned and anyone on the
        /// segment can forge them. Only for a segment you trust.
        #[arg(long, env = "VIP_TRUSTED_SEGMENT", conflicts_with = "heartbeat_key_file")]
        trusted_segment: bool,
    },
    /// Check a config file (and, with --node-name, this host for that node) without
    /// running anything. Exit status: 0 ready, 1 invalid file, 2 host not ready.
    Check {
        /// The YAML config (see deploy/file/vip.yaml).
        file: PathBuf,
        /// Also check this host as that node: VIPs it backs on lo, ARP sysctls.
        #[arg(long, env = "VIP_NODE_NAME")]
        node_name: Option<String>,
        /// The uplink whose ARP sysctls count (with --node-name).
        #[arg(long, env = "VIP_IFACE", default_value = "all")]
        iface: String,
    },
    /// Print the VipPool CustomResourceDefinition (YAML), as committed in deploy/crd.yaml.
    Crd,
    /// Load the XDP program (re-using pinned maps) and attach it to an interface.
    Attach {
        #[arg(long)]
        iface: String,
        #[arg(long, value_enum, default_value = "auto")]
        mode: AttachMode,
        /// Slots in lb4_ring shared by all services' rings (only used when the map is created).
        #[arg(long, default_value_t = vip_common::DEFAULT_RING_CAPACITY)]
        ring_capacity: u32,
    },
    /// Detach from an interface; with --purge also remove every pinned map.
    Detach {
        #[arg(long)]
        iface: Option<String>,
        #[arg(long)]
        purge: bool,
    },
    /// Remove what vip leaves on this node when uninstalled: detach the program
    /// from every interface, remove the pinned program and maps, vip's addresses on
    /// lo and the status file. The agent must not be running.
    Cleanup {
        #[arg(long, env = "VIP_STATUS_FILE", default_value = "/run/vip/status.json")]
        status_file: PathBuf,
        /// Then wait until terminated (a DaemonSet's container: deploy/cleanup/).
        #[arg(long)]
        wait: bool,
    },
    /// Decode the pinned maps: held VIPs, services, backends, counters; with the
    /// agent's status file, also owners and backend health.
    Inspect {
        #[arg(long)]
        json: bool,
        #[arg(long, env = "VIP_STATUS_FILE", default_value = "/run/vip/status.json")]
        status_file: PathBuf,
    },
}

fn init_logs(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if json {
        fmt.json().init();
    } else {
        fmt.init();
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logs(matches!(cli.cmd, Cmd::Run { log_json: true, .. }));
    match cli.cmd {
        Cmd::Run {
            config,
            kubernetes,
            kubeconfig,
            lease_namespace,
            node_name,
            iface,
            mode,
            ring_capacity,
            metrics_addr,
            status_file,
            reload_interval,
            arp_sender,
            log_json: _,
            heartbeat_key_file,
            heartbeat_secret,
            trusted_segment,
        } => {
            let heartbeat_key = match (heartbeat_key_file, trusted_segment) {
                (Some(file), _) => agent::HeartbeatKey::File(file),
                (None, true) => agent::HeartbeatKey::Trusted,
                (None, false) if kubernetes => agent::HeartbeatKey::Secret(heartbeat_secret),
                (None, false) => anyhow::bail!(
                    "heartbeats need a cluster key: --heartbeat-key-file FILE (one key of at least 32 bytes per line, the same \
                     file on every node; make one with `head -c 48 /dev/urandom | base64`), or --trusted-segment to run \
                     without authentication on a segment you trust"
                ),
            };
            let source = match config {
                Some(path) => agent::Source::File(path),
                None => agent::Source::Kubernetes { lease_namespace, kubeconfig },
            };
            let node_name = match node_name {
                Some(n) => n,
                None => hostname()?,
            };
            let metrics_addr = match metrics_addr.as_str() {
                "off" => None,
                a => Some(a.parse::<SocketAddr>().map_err(|e| anyhow::anyhow!("--metrics-addr {a:?}: {e}"))?),
            };
            let opts = agent::Options {
                source,
                node_name,
                iface,
                attach_mode: mode,
                pin_dir: cli.pin_dir,
                ring_capacity,
                metrics_addr,
                status_file: Some(status_file),
                reload_interval,
                arp_sender,
                heartbeat_key,
            };
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(agent::run(opts))?;
        }
        Cmd::Check { file, node_name, iface } => std::process::exit(check(&file, node_name.as_deref(), &iface)),
        Cmd::Crd => print!("{}", vip_agent::k8s::crd::crd_yaml()),
        Cmd::Attach { iface, mode, ring_capacity } => {
            let mut dp = Dataplane::load(&cli.pin_dir, ring_capacity)?;
            let a = dp.attach(&iface, mode)?;
            match a.mode {
                Some(m) => println!("attached to {iface} (ifindex {}) in {m:?} mode; pins in {}", a.ifindex, cli.pin_dir.display()),
                None => println!("already attached to {iface}; kept the existing attachment"),
            }
        }
        Cmd::Detach { iface, purge } => {
            if let Some(iface) = iface {
                let had = dataplane::detach(&cli.pin_dir, &iface)?;
                println!("{}", if had { format!("detached from {iface}") } else { format!("not attached to {iface}") });
            }
            if purge && cli.pin_dir.exists() {
                std::fs::remove_dir_all(&cli.pin_dir)?;
                println!("removed {}", cli.pin_dir.display());
            }
        }
        Cmd::Cleanup { status_file, wait } => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let removed = rt.block_on(vip_agent::cleanup::cleanup(&cli.pin_dir, &status_file))?;
            print!("{removed}");
            if wait {
                rt.block_on(async {
                    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                    term.recv().await;
                    anyhow::Ok(())
                })?;
            }
        }
        Cmd::Inspect { json, status_file } => {
            let dp = Dataplane::open(&cli.pin_dir)?;
            let status = std::fs::read_to_string(&status_file).ok().and_then(|t| serde_json::from_str(&t).ok());
            let r = inspect::report(&dp, status)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", inspect::render(&r));
            }
        }
    }
    Ok(())
}

/// `vip-agent check`: the exit status (0 ready, 1 invalid file, 2 host not ready).
fn check(file: &std::path::Path, node_name: Option<&str>, iface: &str) -> i32 {
    let world = match std::fs::read_to_string(file).map_err(|e| e.to_string()).and_then(|t| vip_agent::config::parse(&t).map_err(|e| e.to_string())) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("{}: {e}", file.display());
            return 1;
        }
    };
    let ports: usize = world.services.iter().map(|s| s.ports.len()).sum();
    let addresses: usize = world.pools.iter().map(|p| p.addresses.len()).sum();
    println!(
        "{}: valid: {} nodes, {} pools ({addresses} addresses), {} services ({ports} service-ports)",
        file.display(),
        world.nodes.len(),
        world.pools.len(),
        world.services.len()
    );
    for w in vip_agent::config::warnings(&world) {
        println!("warning: {w}");
    }
    let Some(me) = node_name else { return 0 };
    if world.node(me).is_none() {
        eprintln!("{}: nodes: this node ({me:?}) is not listed", file.display());
        return 1;
    }
    let vips = preflight::backed_vips(&world, me);
    let facts = preflight::HostFacts::read(iface, vips.iter().copied());
    let mut problems = preflight::problems(&vips, preflight::Intake::VipOnLo, iface, &facts);
    // Where each pool this node may hold lives here (--iface as the agent takes it).
    let default_iface = (iface != "all").then_some(iface);
    match vip_agent::links::read_host() {
        Ok(host) => {
            let links = vip_agent::links::resolve(&world, me, default_iface, &host);
            for (pool, l) in &links.by_pool {
                let vlan = l.vlan.map_or_else(String::new, |v| format!(", VLAN {v} of {}", l.xdp_iface));
                println!("host: pool {pool:?} answered on {}{vlan}", l.name);
            }
            problems.extend(links.problems);
        }
        Err(e) => problems.push(format!("cannot read this host's interfaces: {e:#}")),
    }
    for p in &problems {
        println!("host: {p}");
    }
    if problems.is_empty() {
        println!("host: ready as node {me:?}");
        0
    } else {
        2
    }
}

fn hostname() -> Result<String> {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(h.trim().to_owned())
}
