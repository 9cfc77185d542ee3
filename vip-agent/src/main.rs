use std::path::Path;

use anyhow::{bail, Result};
use clap::Parser;
use vip_agent::{
    agent,
    cli::{CheckArgs, Cli, Cmd, DetachArgs, ImportFrom, InspectArgs, MetallbImportArgs},
    dataplane::{self, Dataplane},
    inspect, preflight,
};

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
    init_logs(matches!(&cli.cmd, Cmd::Run(r) if r.log_json));
    match cli.cmd {
        Cmd::Run(r) => {
            let opts = agent::Options::from_args(*r, cli.pin_dir)?;
            tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?.block_on(async {
                let stop = agent::stop_signals()?;
                agent::run(opts, stop).await
            })?;
        }
        Cmd::Check(c) => std::process::exit(check(&c)),
        Cmd::Crd => print!("{}", vip_agent::k8s::crd::crd_yaml()),
        Cmd::Attach(a) => {
            let mut dp = Dataplane::load(&cli.pin_dir, a.ring_capacity)?;
            let done = dp.attach(&a.iface, a.mode)?;
            match done.mode {
                Some(m) => println!("attached to {} (ifindex {}) in {m:?} mode; pins in {}", a.iface, done.ifindex, cli.pin_dir.display()),
                None => println!("already attached to {}; kept the existing attachment", a.iface),
            }
        }
        Cmd::Detach(d) => detach(&cli.pin_dir, &d)?,
        Cmd::Cleanup(c) => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let removed = rt.block_on(vip_agent::cleanup::cleanup(&cli.pin_dir, &c.status_file))?;
            print!("{removed}");
            if c.wait {
                rt.block_on(async {
                    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
                    term.recv().await;
                    anyhow::Ok(())
                })?;
            }
        }
        Cmd::Inspect(i) => inspect_cmd(&cli.pin_dir, &i)?,
        Cmd::Import(i) => match i.from {
            ImportFrom::Metallb(m) => import_metallb(&m)?,
        },
    }
    Ok(())
}

/// `vip-agent import metallb`: VipPools on stdout, warnings (and a summary) on
/// stderr; fails only when the input cannot be read.
fn import_metallb(m: &MetallbImportArgs) -> Result<()> {
    use anyhow::Context as _;
    use vip_agent::k8s::{self, metallb_import};
    let objects = if m.from_cluster {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(async {
            let client = k8s::kube_client(m.kubeconfig.as_deref()).await?;
            metallb_import::from_cluster(&client, &m.namespace).await
        })?
    } else {
        let mut all = Vec::new();
        for f in &m.files {
            let (name, text) = if f.as_os_str() == "-" {
                ("stdin".to_owned(), std::io::read_to_string(std::io::stdin()).context("reading stdin")?)
            } else {
                (f.display().to_string(), std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?)
            };
            all.extend(metallb_import::documents(&text).with_context(|| format!("reading {name}"))?);
        }
        all
    };
    let import = metallb_import::import(&objects);
    for w in &import.warnings {
        eprintln!("{w}");
    }
    eprintln!("# {} VipPool(s) from {} MetalLB object(s), {} warning(s)", import.pools.len(), import.objects, import.warnings.len());
    print!("{}", metallb_import::to_yaml(&import));
    Ok(())
}

/// `vip-agent detach`: refuses without a target, and says what it removed.
fn detach(dir: &Path, d: &DetachArgs) -> Result<()> {
    if d.iface.is_none() && !d.all && !d.purge {
        bail!(
            "detach needs a target: --iface IFACE (one interface), --all (every interface with a link pinned under {}), \
             or --purge (remove the program, links and maps)",
            dir.display()
        );
    }
    let ifaces = match (&d.iface, d.all) {
        (Some(i), _) => vec![i.clone()],
        (None, true) => dataplane::pinned_links(dir)?,
        (None, false) => Vec::new(),
    };
    if d.all && ifaces.is_empty() {
        println!("no link pinned under {}: the program is attached nowhere by vip", dir.join("links").display());
    }
    for iface in &ifaces {
        if dataplane::detach(dir, iface)? {
            println!("detached from {iface}");
        } else {
            println!("not attached to {iface} (no link pinned at {})", dir.join("links").join(iface).display());
        }
    }
    if d.purge {
        if !dir.exists() {
            println!("nothing to purge: {} does not exist", dir.display());
            return Ok(());
        }
        let mut pins: Vec<String> = std::fs::read_dir(dir)?.map(|e| Ok(e?.file_name().to_string_lossy().into_owned())).collect::<Result<_>>()?;
        pins.sort();
        let links = dataplane::pinned_links(dir)?;
        for iface in &links {
            dataplane::detach(dir, iface)?;
        }
        std::fs::remove_dir_all(dir).map_err(|e| anyhow::anyhow!("removing {}: {e}", dir.display()))?;
        pins.retain(|p| p != "links");
        println!("removed {}: {}", dir.display(), if pins.is_empty() { "(empty)".to_owned() } else { pins.join(", ") });
        if !links.is_empty() {
            println!("detached from {} (their links were pinned there)", links.join(", "));
        }
    }
    Ok(())
}

/// `vip-agent inspect`: the pinned maps, named with the agent's status.
fn inspect_cmd(dir: &Path, i: &InspectArgs) -> Result<()> {
    if !dir.exists() {
        bail!(
            "no vip data path on this node: {} does not exist. The agent has not run here (in Kubernetes: is a vip-agent pod \
             scheduled on this node? `kubectl -n vip-system get pods -o wide`), or it uses another --pin-dir (VIP_PIN_DIR)",
            dir.display()
        );
    }
    let dp = Dataplane::open(dir).map_err(|e| match std::fs::read_dir(dir) {
        Err(re) if re.kind() == std::io::ErrorKind::PermissionDenied => {
            anyhow::anyhow!("reading the pinned maps in {} needs root (or CAP_BPF): {e:#}", dir.display())
        }
        _ => e,
    })?;
    let (info, status) = inspect::read_status(&i.status_file, vip_agent::status::unix_ms_now());
    let r = inspect::report(&dp, info, status)?;
    if i.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        print!("{}", inspect::render(&r, i.verbose));
    }
    Ok(())
}

/// `vip-agent check`: the exit status (0 ready, 1 invalid file, 2 host not ready).
fn check(args: &CheckArgs) -> i32 {
    let (file, node_name) = (args.path(), args.node_name.as_deref());
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
    let Some(node) = world.node(me) else {
        eprintln!("{}: nodes: this node ({me:?}) is not listed; --node-name takes one of the listed names", file.display());
        return 1;
    };
    // Where each pool this node may hold lives here, and the node's home, as the
    // agent finds them (--iface means what it means for `run`).
    let default_iface = args.iface.as_deref();
    let mut problems = Vec::new();
    let home = match vip_agent::links::read_host() {
        Ok(host) => {
            let links = vip_agent::links::resolve(&world, me, default_iface, &host);
            for (pool, l) in &links.by_pool {
                let vlan = l.vlan.map_or_else(String::new, |v| format!(", VLAN {v} of {}", l.xdp_iface));
                println!("host: pool {pool:?} answered on {}{vlan}", l.name);
            }
            problems.extend(links.problems);
            match vip_agent::links::home(node.addr, default_iface, &host) {
                Ok(l) => Some(l.name),
                Err(why) => {
                    problems.push(why.to_string());
                    None
                }
            }
        }
        Err(e) => {
            problems.push(format!("cannot read this host's interfaces: {e:#}"));
            None
        }
    };
    // ARP sysctls matter where the node is reached (its home), as in `run`.
    let sysctl_iface = home.as_deref().unwrap_or("all");
    let vips = preflight::backed_vips(&world, me);
    let facts = preflight::HostFacts::read(sysctl_iface, vips.iter().copied());
    problems.splice(0..0, preflight::problems(&vips, preflight::Intake::VipOnLo, sysctl_iface, &facts));
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
