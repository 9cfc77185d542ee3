use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use vip_agent::{
    dataplane::{self, AttachMode, Dataplane},
    inspect,
};

#[derive(Parser)]
#[command(name = "vip-agent", version, about = "vip: bare-metal virtual IP load balancer, node agent")]
struct Cli {
    /// bpffs directory holding the pinned program, links and maps.
    #[arg(long, global = true, env = "VIP_PIN_DIR", default_value = dataplane::DEFAULT_PIN_DIR)]
    pin_dir: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
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
    /// Decode the pinned maps: held VIPs, services, backends, counters.
    Inspect {
        #[arg(long)]
        json: bool,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    match cli.cmd {
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
        Cmd::Inspect { json } => {
            let dp = Dataplane::open(&cli.pin_dir)?;
            let r = inspect::report(&dp)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", inspect::render(&r));
            }
        }
    }
    Ok(())
}
