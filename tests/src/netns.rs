//! Network namespaces for tests, removed on Drop (also when a test fails), and
//! helpers to run code or commands inside them. Only 198.18.0.0/15 addresses.
use std::{
    fs::File,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
};

use anyhow::{bail, Context as _, Result};

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A unique short name for this process and call: `prefix` + pid + counter.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}{}x{}", std::process::id() % 100_000, SEQ.fetch_add(1, Ordering::Relaxed))
}

/// Runs a command; fails with its stderr when it fails.
pub fn sh(args: &[&str]) -> Result<Output> {
    let o = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("starting {args:?}"))?;
    if !o.status.success() {
        bail!("{args:?} failed: {}", String::from_utf8_lossy(&o.stderr));
    }
    Ok(o)
}

pub struct NetNs {
    pub name: String,
}

impl NetNs {
    pub fn new(prefix: &str) -> Result<Self> {
        Self::create(unique(prefix))
    }

    /// A namespace with exactly this name (the persistent lab uses fixed names).
    pub fn create(name: String) -> Result<Self> {
        sh(&["ip", "netns", "add", &name])?;
        let ns = Self { name };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// `ip -n NS ARGS...`
    pub fn ip(&self, args: &[&str]) -> Result<Output> {
        let mut a = vec!["ip", "-n", &self.name];
        a.extend_from_slice(args);
        sh(&a)
    }

    /// A command run inside the namespace (network only; mounts stay, so bpffs too).
    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path().display())).arg("--").arg(program);
        c
    }

    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        let o = self.cmd("sysctl").args(["-qw", &format!("{key}={value}")]).output()?;
        if !o.status.success() {
            bail!("sysctl {key}={value} in {}: {}", self.name, String::from_utf8_lossy(&o.stderr));
        }
        Ok(())
    }

    /// `nft ARGS` in this namespace; its output, or an error with what nft said.
    pub fn nft(&self, args: &[&str]) -> Result<String> {
        let o = self.cmd("nft").args(args).output()?;
        if !o.status.success() {
            bail!("nft {} in {}: {}", args.join(" "), self.name, String::from_utf8_lossy(&o.stderr));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    }

    /// Runs `f` on a new thread that has entered this namespace; sockets made
    /// there stay in it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        self.spawn(f)?.join().map_err(|_| anyhow::anyhow!("thread in {} panicked", self.name))
    }

    /// Spawns a long-running thread inside the namespace.
    pub fn spawn<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<std::thread::JoinHandle<T>> {
        spawn_in(&self.path(), f)
    }

    /// MAC of `iface` in this namespace.
    pub fn mac(&self, iface: &str) -> Result<[u8; 6]> {
        let o = self.ip(&["-br", "link", "show", iface])?;
        let s = String::from_utf8_lossy(&o.stdout);
        let mac = s.split_whitespace().nth(2).context("no MAC in ip output")?;
        let b: Vec<u8> = mac.split(':').map(|x| u8::from_str_radix(x, 16)).collect::<Result<_, _>>()?;
        b.try_into().map_err(|_| anyhow::anyhow!("bad MAC {mac}"))
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace removes its veth ends (and their peers).
        // Quietly: a cluster's reaper may have deleted it already.
        let _ = Command::new("ip").args(["netns", "del", &self.name]).stderr(std::process::Stdio::null()).status();
    }
}

/// Spawns a thread inside the network namespace at `path` (`/run/netns/NAME`).
pub fn spawn_in<T: Send + 'static>(path: &Path, f: impl FnOnce() -> T + Send + 'static) -> Result<std::thread::JoinHandle<T>> {
    let file = File::open(path)?;
    Ok(std::thread::spawn(move || {
        // SAFETY: valid namespace fd; only this thread changes namespace.
        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            panic!("setns: {}", std::io::Error::last_os_error());
        }
        f()
    }))
}

/// Connects `a`:`a_if` to `b`:`b_if` with a veth pair, both up.
pub fn veth(a: &NetNs, a_if: &str, b: &NetNs, b_if: &str) -> Result<()> {
    sh(&["ip", "-n", &a.name, "link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.name])?;
    a.ip(&["link", "set", a_if, "up"])?;
    b.ip(&["link", "set", b_if, "up"])?;
    Ok(())
}

/// A trivial XDP program (`r0 = XDP_PASS; exit`), loaded once per process with
/// bpf(2) directly: the lab needs no object file for it.
fn pass_program() -> Result<std::os::fd::BorrowedFd<'static>> {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};
    // The leading fields of union bpf_attr for BPF_PROG_LOAD; the rest stays zero.
    #[repr(C)]
    struct ProgLoad {
        prog_type: u32,
        insn_cnt: u32,
        insns: u64,
        license: u64,
        log_level: u32,
        log_size: u32,
        log_buf: u64,
        kern_version: u32,
        prog_flags: u32,
        prog_name: [u8; 16],
        rest: [u64; 8],
    }
    static PROG: std::sync::OnceLock<Result<OwnedFd, String>> = std::sync::OnceLock::new();
    let prog = PROG.get_or_init(|| {
        // BPF_ALU64|BPF_MOV|BPF_K r0 = 2 (XDP_PASS); BPF_JMP|BPF_EXIT.
        let insns: [u64; 2] = [u64::from_le_bytes([0xb7, 0, 0, 0, 2, 0, 0, 0]), u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0])];
        let mut name = [0u8; 16];
        name[..8].copy_from_slice(b"lab_wire");
        let attr = ProgLoad {
            prog_type: 6, // BPF_PROG_TYPE_XDP
            insn_cnt: 2,
            insns: insns.as_ptr() as u64,
            license: c"GPL".as_ptr() as u64,
            log_level: 0,
            log_size: 0,
            log_buf: 0,
            kern_version: 0,
            prog_flags: 0,
            prog_name: name,
            rest: [0; 8],
        };
        // SAFETY: BPF_PROG_LOAD (5) with an attr of the stated size whose pointers
        // outlive the call.
        let fd = unsafe { libc::syscall(libc::SYS_bpf, 5, &attr as *const ProgLoad, std::mem::size_of::<ProgLoad>()) };
        if fd < 0 {
            return Err(format!("BPF_PROG_LOAD of the lab's XDP_PASS program: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: a new fd that only this OwnedFd owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    });
    prog.as_ref().map(|fd| fd.as_fd()).map_err(|e| anyhow::anyhow!("{e}"))
}

/// Attaches a trivial XDP_PASS program to `iface` in `ns` in native (driver) mode.
///
/// On a veth this is what lets the *other* end's native XDP_TX arrive: the
/// kernel's veth_xdp_flush wakes the receiving end's NAPI only when that end has
/// an XDP program (GRO alone gives it NAPI, but frames sent with XDP_TX then wait
/// in its ring until other traffic wakes it). Attached over netlink, the
/// program stays with the device (also after this process exits, for the
/// persistent lab) and goes with it.
pub fn attach_xdp_pass(ns: &NetNs, iface: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    // `ip` attaches a pinned program: pin it in a directory of our own, removed
    // right after (the attachment holds the program).
    let dir = PinDir::new()?;
    let pin = dir.path.join("xdp_pass");
    let path = std::ffi::CString::new(pin.as_os_str().as_encoded_bytes())?;
    // union bpf_attr for BPF_OBJ_PIN: pathname, bpf_fd, file_flags, path_fd.
    let attr: [u64; 3] = [path.as_ptr() as u64, pass_program()?.as_raw_fd() as u64, 0];
    // SAFETY: BPF_OBJ_PIN (6) with an attr whose path outlives the call.
    if unsafe { libc::syscall(libc::SYS_bpf, 6, attr.as_ptr(), std::mem::size_of_val(&attr)) } < 0 {
        bail!("pinning the XDP_PASS program at {}: {}", pin.display(), std::io::Error::last_os_error());
    }
    // Not `ip -n`: it mounts a sysfs of the namespace's own, without our bpffs.
    let o = ns.cmd("ip").args(["link", "set", "dev", iface, "xdpdrv", "pinned"]).arg(&pin).output().context("starting ip")?;
    if !o.status.success() {
        bail!("attaching XDP_PASS to {iface} in {}: {}", ns.name, String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

/// `ethtool -K iface FEATURE on|off ...` in `ns`.
pub fn ethtool_features(ns: &NetNs, iface: &str, features: &[&str]) -> Result<()> {
    let o = ns.cmd("ethtool").args(["-K", iface]).args(features).output().context("starting ethtool")?;
    if !o.status.success() {
        bail!("ethtool -K {iface} {features:?} in {}: {}", ns.name, String::from_utf8_lossy(&o.stderr));
    }
    Ok(())
}

/// A bpffs directory for one test, removed (with everything pinned) on Drop.
pub struct PinDir {
    pub path: PathBuf,
}

impl PinDir {
    pub fn new() -> Result<Self> {
        let path = PathBuf::from("/sys/fs/bpf").join(unique("vip-test-"));
        vip_agent::dataplane::ensure_bpffs_dir(&path)?;
        Ok(Self { path })
    }
}

impl PinDir {
    /// A bpffs directory at `path` (created if missing), removed on Drop.
    pub fn at(path: PathBuf) -> Result<Self> {
        vip_agent::dataplane::ensure_bpffs_dir(&path)?;
        Ok(Self { path })
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Whether the privileged tests can run here. Without root they are skipped with
/// a message, except under CI (CI=true), where skipping is a failure.
pub fn privileged() -> bool {
    // SAFETY: no arguments.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!("CI=true but not root: the BPF and netns tests must run in CI");
        }
        eprintln!("skipping: BPF/netns tests need root (they run under CI=true)");
    }
    root
}

/// A MAC as arping prints it (upper-case hex pairs).
pub fn hex_mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02X}")).collect::<Vec<_>>().join(":")
}

/// Two ARP requests for `target` from `ns` out of `iface` (2 s at most): whether
/// one was answered, and arping's output.
pub fn arping(ns: &NetNs, iface: &str, target: std::net::Ipv4Addr) -> (bool, String) {
    let o = ns.cmd("arping").args(["-c", "2", "-w", "2", "-I", iface, &target.to_string()]).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stdout).into_owned())
}

/// The packets an nftables `counter` shows in `line` (`counter packets N bytes M`).
pub fn nft_packets(line: &str) -> Option<u64> {
    line.split("counter packets ").nth(1)?.split_whitespace().next()?.parse().ok()
}

/// Whether this kernel lets root transmit through XDP (BPF_PROG_RUN in
/// live-frames mode): `Err` with the kernel's answer where it refuses (some builds
/// answer EPERM even to root). Probed as the agent probes: a header-only frame,
/// which `vip_xmit` drops, so nothing is sent; on the `lo` of a namespace of
/// its own all the same.
pub fn xdp_transmit_refused() -> Option<String> {
    let pins = PinDir::new().unwrap();
    let _dp = vip_agent::dataplane::Dataplane::load(&pins.path, 1 << 12).unwrap();
    let x = vip_agent::dataplane::XdpXmit::open(&pins.path).unwrap();
    let ns = NetNs::new("vxp").unwrap();
    ns.ip(&["link", "set", "lo", "up"]).unwrap();
    // Every namespace's lo is interface 1.
    ns.run(move || x.probe(1).err().map(|e| format!("{e:#}"))).unwrap()
}
