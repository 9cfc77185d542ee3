//! A real Kubernetes API server for the tests: `kube-apiserver` and `etcd` from
//! `$KUBEBUILDER_ASSETS` (controller-runtime's envtest layout; `setup-envtest use`
//! downloads one), started on free loopback ports in a temporary directory with
//! certificates made here (a CA, a serving certificate, an admin client certificate
//! in `system:masters`, a service-account signing key) and RBAC on.
//!
//! Only the API server and etcd run: no controller manager, scheduler or kubelet, so
//! nothing makes EndpointSlices, Node status, garbage collection or namespace
//! finalisation; tests do what they need of that themselves.
//!
//! Children get `PR_SET_PDEATHSIG` (SIGKILL) from a [`Keeper`] thread that lives as
//! long as the harness, so a test binary that panics, aborts or exits never leaves a
//! server behind; [`RealApiServer::shared`] also removes its directory at exit.
//! [`Keeper`], [`Ca`] and [`Options`] also serve the multi-node cluster
//! (`crate::cluster`), which runs this server as its control plane.
//!
//! [`Backend`] lets a test body run against this server or the in-process stand-in
//! (`crate::apiserver`).
use std::{
    fs::File,
    future::Future,
    io::Read,
    net::{IpAddr, Ipv4Addr, TcpListener},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::process::CommandExt,
    },
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{mpsc, Mutex, MutexGuard, OnceLock},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use http::{Method, Request};
use kube::{config::KubeConfigOptions, Client};
use serde_json::{json, Value};

pub use crate::apiserver::Stack;
use crate::{
    agent::TempDir,
    apiserver::{ApiServer, ResourceSpec},
};

pub const SKIP_MESSAGE: &str =
    "not run: set KUBEBUILDER_ASSETS to a directory holding kube-apiserver and etcd (controller-runtime's envtest layout; docs/development/tests.md says how to get them)";

/// The repository's deploy/ directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The directory of `kube-apiserver` and `etcd` from `KUBEBUILDER_ASSETS`; `None`
/// (after printing why) when it is not set. Tests that need it are built
/// `#[ignore]`d without it (tests/build.rs), so only the benchmarks meet `None`;
/// a test built with it that finds it gone fails rather than passing untried.
pub fn assets() -> Option<PathBuf> {
    match std::env::var_os("KUBEBUILDER_ASSETS").filter(|v| !v.is_empty()) {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            for bin in ["kube-apiserver", "etcd"] {
                assert!(dir.join(bin).is_file(), "KUBEBUILDER_ASSETS={}: no {bin} there", dir.display());
            }
            Some(dir)
        }
        None if cfg!(real_apiserver) => panic!("KUBEBUILDER_ASSETS was set when the tests were built and is not set now ({SKIP_MESSAGE})"),
        None => {
            eprintln!("{SKIP_MESSAGE}");
            None
        }
    }
}

/// Where and how to run the server.
#[derive(Clone, Debug)]
pub struct Options {
    /// The address etcd and the API server listen on (and the serving certificate names).
    pub host: IpAddr,
    /// A network namespace (e.g. `/run/netns/NAME`) to run both processes in, so that
    /// agents in a lab reach the server; the harness's own requests enter it too.
    pub netns: Option<PathBuf>,
    /// The API server's port; `None`: a free one.
    pub port: Option<u16>,
    /// `--service-cluster-ip-range`: one CIDR, or an IPv4 and an IPv6 one separated
    /// by a comma for a dual-stack cluster ([`Options::dual_stack`]). The first
    /// address of the IPv4 one is the `kubernetes` Service's, which the serving
    /// certificate names too.
    pub service_cidr: String,
    /// The `lease` endpoint reconciler (the `kubernetes` Service gets `host` as its
    /// endpoint, as in a real cluster) instead of `none`.
    pub endpoint_reconciler: bool,
    /// More API server flags; `{dir}` in them stands for the server's directory
    /// (which holds `ca.crt`, `ca.key`, `admin.crt`, `admin.key`, `sa.key`, `sa.pub`).
    pub extra_args: Vec<String>,
    /// A directory of the caller's to work in (kept); `None`: a temporary one.
    pub dir: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            netns: None,
            port: None,
            service_cidr: "10.96.0.0/16".into(),
            endpoint_reconciler: false,
            extra_args: Vec::new(),
            dir: None,
        }
    }
}

/// The dual-stack `--service-cluster-ip-range`: IPv4 first, so IPv4 is the
/// cluster's primary family (what Services without `ipFamilies` get).
pub const DUAL_STACK_SERVICE_CIDR: &str = "10.96.0.0/16,fd00:10:96::/112";
/// The IPv6-only `--service-cluster-ip-range`.
pub const IPV6_SERVICE_CIDR: &str = "fd00:10:96::/112";

impl Options {
    /// The default server, dual-stack: [`DUAL_STACK_SERVICE_CIDR`].
    pub fn dual_stack() -> Self {
        Self { service_cidr: DUAL_STACK_SERVICE_CIDR.into(), ..Self::default() }
    }

    /// The default server, IPv6-only: [`IPV6_SERVICE_CIDR`].
    pub fn ipv6_only() -> Self {
        Self { service_cidr: IPV6_SERVICE_CIDR.into(), ..Self::default() }
    }

    /// The server of a cluster of `stack`'s families.
    pub fn of(stack: Stack) -> Self {
        match stack {
            Stack::V4 => Self::default(),
            Stack::Dual => Self::dual_stack(),
            Stack::V6 => Self::ipv6_only(),
        }
    }
}

/// The first address of the primary (first) CIDR of a service range
/// (`198.18.128.0/20` gives 198.18.128.1; `10.96.0.0/16,fd00:10:96::/112`,
/// 10.96.0.1; `fd00:10:96::/112`, fd00:10:96::1): the `kubernetes` Service's
/// ClusterIP.
pub fn first_host(range: &str) -> Result<IpAddr> {
    let cidr = range.split(',').map(str::trim).next().filter(|c| !c.is_empty()).ok_or_else(|| anyhow!("{range}: no CIDR"))?;
    let (net, len) = cidr.split_once('/').ok_or_else(|| anyhow!("{cidr}: not a CIDR"))?;
    let net: IpAddr = net.parse().with_context(|| format!("{cidr}: bad address"))?;
    let width = if net.is_ipv4() { 32 } else { 128 };
    let len: u32 = len.parse().ok().filter(|l| *l < width - 1).ok_or_else(|| anyhow!("{cidr}: bad prefix length"))?;
    Ok(match net {
        IpAddr::V4(n) => Ipv4Addr::from((u32::from(n) & u32::MAX.checked_shl(32 - len).unwrap_or(0)) + 1).into(),
        IpAddr::V6(n) => std::net::Ipv6Addr::from((u128::from(n) & u128::MAX.checked_shl(128 - len).unwrap_or(0)) + 1).into(),
    })
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread that spawns children with `PR_SET_PDEATHSIG` (SIGKILL): the signal
/// comes when the *thread* that forked them ends, so they all die when the last
/// clone of the keeper is dropped, or when the test binary exits, panics out or is
/// killed. Clones share the thread.
#[derive(Clone)]
pub struct Keeper(mpsc::Sender<Job>);

impl Keeper {
    pub fn new(name: &str) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new().name(name.into()).spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        })?;
        Ok(Self(tx))
    }

    /// Spawns `cmd` from the keeper thread, with the death signal (and whatever
    /// [`enter`] added).
    pub fn spawn(&self, mut cmd: Command) -> Result<Child> {
        enter(&mut cmd, Vec::new());
        let what = cmd.get_program().to_string_lossy().into_owned();
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move || {
            let _ = tx.send(cmd.spawn());
        });
        self.0.send(job).map_err(|_| anyhow!("the keeper thread is gone"))?;
        rx.recv()?.with_context(|| format!("starting {what}"))
    }
}

/// Makes `cmd`'s child enter the namespaces `ns` (nsfs files: `/run/netns/NAME`,
/// `/proc/PID/ns/mnt`, ...; in that order) before it executes, and get SIGKILL
/// when the thread that spawns it ends. The command owns the files.
pub fn enter(cmd: &mut Command, ns: Vec<OwnedFd>) {
    // SAFETY: only async-signal-safe syscalls between fork and exec. Entering a
    // mount namespace is allowed there: the child is single-threaded.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            for fd in &ns {
                if libc::setns(fd.as_raw_fd(), 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// A certificate authority for a test cluster: it signs the serving and client
/// certificates (PEM) of every component.
pub struct Ca {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

fn cert_params(cn: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2120, 1, 1);
    let mut dn = rcgen::DistinguishedName::new();
    dn.push(rcgen::DnType::CommonName, cn);
    p.distinguished_name = dn;
    p
}

impl Ca {
    pub fn new() -> Result<Self> {
        use rcgen::{BasicConstraints, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose};
        let mut params = cert_params("vip-tests-ca");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        Ok(Self { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate()?)? })
    }

    /// The CA certificate.
    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// The CA key (for a controller manager that signs CSRs).
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// A client certificate and its key: user `cn` in groups `orgs` for the API
    /// server's x509 authenticator.
    pub fn client(&self, cn: &str, orgs: &[&str]) -> Result<(String, String)> {
        use rcgen::{DnType, ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose};
        let mut p = cert_params(cn);
        for o in orgs {
            p.distinguished_name.push(DnType::OrganizationName, *o);
        }
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        Ok((p.signed_by(&key, &self.issuer)?.pem(), key.serialize_pem()))
    }

    /// A serving certificate and its key for `ips` and `dns` names.
    pub fn server(&self, cn: &str, ips: &[IpAddr], dns: &[&str]) -> Result<(String, String)> {
        use rcgen::{ExtendedKeyUsagePurpose, KeyPair, KeyUsagePurpose, SanType};
        let mut p = cert_params(cn);
        p.subject_alt_names = ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
        for d in dns {
            p.subject_alt_names.push(SanType::DnsName((*d).try_into()?));
        }
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate()?;
        Ok((p.signed_by(&key, &self.issuer)?.pem(), key.serialize_pem()))
    }
}

struct Procs {
    etcd: Option<Child>,
    apiserver: Option<Child>,
}

/// Certificates and keys, PEM.
struct Pki {
    ca: Ca,
    admin_cert: String,
    admin_key: String,
}

pub struct RealApiServer {
    dir: PathBuf,
    /// Removes `dir` on Drop unless the caller gave it ([`Options::dir`]).
    _temp: Option<TempDir>,
    bin: PathBuf,
    opts: Options,
    etcd_url: String,
    port: u16,
    url: String,
    pki: Pki,
    procs: Mutex<Procs>,
    keeper: Keeper,
    startup: Duration,
    version: String,
}

/// `N` distinct free ports: all probed at once (one at a time, the kernel may hand
/// out the same port twice, and etcd then fails to bind its second listener).
fn free_ports<const N: usize>(host: IpAddr) -> [u16; N] {
    // Outside a namespace of its own the port is probed where the server will bind;
    // in a fresh namespace any port is free, so probing loopback here is enough.
    let probe = if host.is_loopback() { host } else { IpAddr::V4(Ipv4Addr::LOCALHOST) };
    let held: Vec<TcpListener> = (0..N).map(|_| TcpListener::bind((probe, 0)).expect("a free port")).collect();
    std::array::from_fn(|i| held[i].local_addr().expect("a bound port").port())
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

fn make_pki(dir: &Path, host: IpAddr, service_ip: IpAddr) -> Result<Pki> {
    let ca = Ca::new()?;
    let mut ips: Vec<IpAddr> = vec![Ipv4Addr::LOCALHOST.into(), service_ip];
    if !ips.contains(&host) {
        ips.push(host);
    }
    let dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"];
    let (serving_cert, serving_key) = ca.server("kube-apiserver", &ips, &dns)?;
    let (admin_cert, admin_key) = ca.client("admin", &["system:masters"])?;
    // Service-account tokens: an ECDSA P-256 key (ES256), which the API server accepts
    // as --service-account-signing-key-file like an RSA one.
    let sa = rcgen::KeyPair::generate()?;

    let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).with_context(|| format!("writing {name}"));
    write("ca.crt", &ca.pem())?;
    write("ca.key", &ca.key_pem())?;
    write("apiserver.crt", &serving_cert)?;
    write("apiserver.key", &serving_key)?;
    write("admin.crt", &admin_cert)?;
    write("admin.key", &admin_key)?;
    write("sa.key", &sa.serialize_pem())?;
    write("sa.pub", &sa.public_key_pem())?;
    Ok(Pki { ca, admin_cert, admin_key })
}

/// Runs `f` to completion on a runtime of its own, on a thread of its own (inside
/// `netns` when given): usable from synchronous code and from inside other runtimes.
fn on_own_runtime<T: Send, F: Future<Output = T>>(netns: Option<PathBuf>, f: impl FnOnce() -> F + Send) -> T {
    std::thread::scope(|scope| {
        scope
            .spawn(move || {
                if let Some(ns) = netns {
                    let file = File::open(&ns).unwrap_or_else(|e| panic!("{}: {e}", ns.display()));
                    // SAFETY: a valid namespace fd; only this thread changes namespace.
                    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                        panic!("setns {}: {}", ns.display(), std::io::Error::last_os_error());
                    }
                }
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
                rt.block_on(f())
            })
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// A response: status, the `Warning` headers, the body as JSON (`Null` if it is not).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub warnings: Vec<String>,
    pub body: Value,
}

impl Reply {
    pub fn ok(self) -> Result<Value> {
        if (200..300).contains(&self.status) {
            Ok(self.body)
        } else {
            bail!("HTTP {}: {}", self.status, self.body)
        }
    }
}

/// A raw request through `client` (its base URL and credentials), `path` from `/`.
pub async fn raw(client: &Client, method: Method, path: &str, content_type: &str, body: Option<&Value>) -> Result<Reply> {
    let mut req = Request::builder().method(method.clone()).uri(path).header("accept", "application/json");
    let bytes = match body {
        Some(b) => {
            req = req.header("content-type", content_type);
            serde_json::to_vec(b)?
        }
        None => Vec::new(),
    };
    let res = client.send(req.body(kube::client::Body::from(bytes))?).await.with_context(|| format!("{method} {path}"))?;
    let status = res.status().as_u16();
    let warnings = res.headers().get_all("warning").iter().map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).collect();
    let bytes = res.into_body().collect_bytes().await?;
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Ok(Reply { status, warnings, body })
}

/// The URL path of a resource named as `kubectl` does (`services`,
/// `leases.coordination.k8s.io`), among those the agent uses ([`ResourceSpec::VIP`]).
pub fn resource_path(resource: &str, ns: Option<&str>) -> String {
    let spec = ResourceSpec::VIP
        .iter()
        .chain([ResourceSpec::CONFIG_MAPS].iter())
        .find(|s| s.qualified() == resource)
        .unwrap_or_else(|| panic!("unknown resource {resource}"));
    let base = if spec.group.is_empty() { "/api/v1".to_owned() } else { format!("/apis/{}/{}", spec.group, spec.version) };
    match ns {
        Some(ns) if spec.namespaced => format!("{base}/namespaces/{ns}/{}", spec.plural),
        _ => format!("{base}/{}", spec.plural),
    }
}

/// A kubeconfig (JSON, which is YAML) for `url` with the CA (none: plain HTTP, the
/// stand-in) and one user, whose requests go to `namespace` when they name none.
pub fn kubeconfig_text(url: &str, ca_pem: Option<&str>, user: Value, namespace: &str) -> String {
    let mut cluster = json!({ "server": url });
    if let Some(ca) = ca_pem {
        cluster["certificate-authority-data"] = b64(ca).into();
    }
    serde_json::to_string_pretty(&json!({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{ "name": "real", "cluster": cluster }],
        "users": [{ "name": "user", "user": user }],
        "contexts": [{ "name": "real", "context": { "cluster": "real", "user": "user", "namespace": namespace } }],
        "current-context": "real"
    }))
    .unwrap()
}

/// A client from kubeconfig text (must run inside a tokio runtime).
pub async fn client_from_kubeconfig(text: &str) -> Result<Client> {
    let kc = kube::config::Kubeconfig::from_yaml(text)?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    Ok(Client::try_from(cfg)?)
}

impl RealApiServer {
    /// Starts etcd and the API server on loopback; `None` when there are no binaries
    /// (see [`assets`]). Panics when they do not come up.
    pub fn start() -> Option<Self> {
        Self::start_with(Options::default())
    }

    pub fn start_with(opts: Options) -> Option<Self> {
        let bin = assets()?;
        Some(Self::launch(bin, opts).unwrap_or_else(|e| panic!("the real API server did not start: {e:#}")))
    }

    /// One server for the whole test binary, left running until the binary exits
    /// (then killed, its directory removed). Each test builds its own clients.
    pub fn shared() -> Option<&'static Self> {
        Self::shared_with(Stack::V4)
    }

    /// [`Self::shared`] of an IPv4-only or a dual-stack cluster ([`Options::dual_stack`]):
    /// one of each at most per test binary, started when first asked for.
    pub fn shared_with(stack: Stack) -> Option<&'static Self> {
        static SHARED: [OnceLock<Option<RealApiServer>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
        extern "C" fn cleanup() {
            for s in SHARED.iter().filter_map(|s| s.get()?.as_ref()) {
                s.stop();
                let _ = std::fs::remove_dir_all(&s.dir);
            }
        }
        static CLEANUP: std::sync::Once = std::sync::Once::new();
        let i = match stack {
            Stack::V4 => 0,
            Stack::Dual => 1,
            Stack::V6 => 2,
        };
        let opts = Options::of(stack);
        SHARED[i]
            .get_or_init(|| {
                let s = Self::start_with(opts)?;
                // SAFETY: registers a plain function.
                CLEANUP.call_once(|| unsafe {
                    libc::atexit(cleanup);
                });
                Some(s)
            })
            .as_ref()
    }

    /// Starts etcd and the API server from the binaries in `bin` and waits until
    /// the server is ready.
    pub fn launch(bin: PathBuf, opts: Options) -> Result<Self> {
        let (dir, temp) = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| d.display().to_string())?;
                (d.clone(), None)
            }
            None => {
                let t = TempDir::new("vip-kube-apiserver-")?;
                (t.0.clone(), Some(t))
            }
        };
        let pki = make_pki(&dir, opts.host, first_host(&opts.service_cidr).context("Options::service_cidr")?)?;
        let [etcd_port, peer_port, api_port] = free_ports::<3>(opts.host);
        let port = opts.port.unwrap_or(api_port);
        let h = match opts.host {
            IpAddr::V6(a) => format!("[{a}]"),
            a => a.to_string(),
        };
        let etcd_url = format!("http://{h}:{etcd_port}");
        let url = format!("https://{h}:{port}");
        let mut s = Self {
            dir,
            _temp: temp,
            bin,
            opts,
            etcd_url,
            port,
            url,
            pki,
            procs: Mutex::new(Procs { etcd: None, apiserver: None }),
            keeper: Keeper::new("kube-apiserver-keeper")?,
            startup: Duration::ZERO,
            version: String::new(),
        };
        let t0 = Instant::now();
        let data = s.dir.join("etcd");
        let etcd = s.spawn(
            "etcd",
            &[
                "--name=vip-tests".into(),
                format!("--data-dir={}", data.display()),
                format!("--listen-client-urls={}", s.etcd_url),
                format!("--advertise-client-urls={}", s.etcd_url),
                format!("--listen-peer-urls=http://{h}:{peer_port}"),
                "--unsafe-no-fsync".into(),
            ],
        )?;
        s.procs.lock().unwrap().etcd = Some(etcd);
        s.spawn_apiserver()?;
        s.version = s.wait_ready(Duration::from_secs(60))?;
        s.startup = t0.elapsed();
        eprintln!("real API server: kube-apiserver {} with etcd at {}, ready {:.1} s after start", s.version, s.url, s.startup.as_secs_f64());
        Ok(s)
    }

    fn spawn(&self, name: &str, args: &[String]) -> Result<Child> {
        let log = File::options().create(true).append(true).open(self.dir.join(format!("{name}.log")))?;
        let mut cmd = Command::new(self.bin.join(name));
        cmd.args(args).current_dir(&self.dir).stdin(Stdio::null()).stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log));
        let ns = self.opts.netns.as_ref().map(|p| File::open(p).map(OwnedFd::from)).transpose().context("opening the network namespace")?;
        enter(&mut cmd, ns.into_iter().collect());
        self.keeper.spawn(cmd)
    }

    fn spawn_apiserver(&self) -> Result<()> {
        let d = |f: &str| self.dir.join(f).display().to_string();
        let mut args = vec![
            format!("--etcd-servers={}", self.etcd_url),
            format!("--bind-address={}", self.opts.host),
            format!("--secure-port={}", self.port),
            format!("--advertise-address={}", self.opts.host),
            format!("--endpoint-reconciler-type={}", if self.opts.endpoint_reconciler { "lease" } else { "none" }),
            format!("--tls-cert-file={}", d("apiserver.crt")),
            format!("--tls-private-key-file={}", d("apiserver.key")),
            format!("--client-ca-file={}", d("ca.crt")),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            format!("--service-cluster-ip-range={}", self.opts.service_cidr),
            "--allow-privileged=true".into(),
            format!("--cert-dir={}", d("certs")),
        ];
        let dir = self.dir.display().to_string();
        args.extend(self.opts.extra_args.iter().map(|a| a.replace("{dir}", &dir)));
        let child = self.spawn("kube-apiserver", &args)?;
        self.procs.lock().unwrap().apiserver = Some(child);
        Ok(())
    }

    fn log_tail(&self, name: &str) -> String {
        log_tail(&self.dir.join(format!("{name}.log")), 30)
    }

    /// The process ids of etcd and the API server, while they run.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        let p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        [("etcd", &p.etcd), ("kube-apiserver", &p.apiserver)].into_iter().filter_map(|(n, c)| Some((n, c.as_ref()?.id()))).collect()
    }

    /// Waits for `/readyz` (as admin); returns the server's gitVersion.
    fn wait_ready(&self, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let cfg = self.kubeconfig_admin_text();
        loop {
            {
                let mut guard = self.procs.lock().unwrap();
                let p = &mut *guard;
                for (name, child) in [("etcd", &mut p.etcd), ("kube-apiserver", &mut p.apiserver)] {
                    if let Some(st) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                        bail!("{name} exited ({st}):\n{}", self.log_tail(name));
                    }
                }
            }
            let cfg = cfg.clone();
            let r = on_own_runtime(self.opts.netns.clone(), move || async move {
                let client = client_from_kubeconfig(&cfg).await?;
                let ready = raw(&client, Method::GET, "/readyz", "", None).await?;
                if ready.status != 200 {
                    bail!("/readyz: {} {}", ready.status, ready.body);
                }
                let v = raw(&client, Method::GET, "/version", "", None).await?.ok()?;
                Ok(v["gitVersion"].as_str().unwrap_or("?").to_owned())
            });
            match r {
                Ok(v) => return Ok(v),
                Err(e) if Instant::now() > deadline => bail!("not ready within {timeout:?}: {e:#}\n{}", self.log_tail("kube-apiserver")),
                Err(_) => std::thread::sleep(Duration::from_millis(200)),
            }
        }
    }

    /// From spawning etcd to `/readyz` answering 200.
    pub fn startup(&self) -> Duration {
        self.startup
    }

    /// The server's `gitVersion` (`GET /version`).
    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA that signed the server's certificates and accepts client certificates.
    pub fn ca(&self) -> &Ca {
        &self.pki.ca
    }

    /// A kubeconfig for a user holding a client certificate (PEM) of [`Self::ca`].
    pub fn kubeconfig_for(&self, cert: &str, key: &str, namespace: &str) -> String {
        kubeconfig_text(&self.url, Some(&self.pki.ca.pem()), json!({ "client-certificate-data": b64(cert), "client-key-data": b64(key) }), namespace)
    }

    pub fn kubeconfig_admin_text(&self) -> String {
        self.kubeconfig_for(&self.pki.admin_cert, &self.pki.admin_key, "vip-system")
    }

    /// Writes a kubeconfig for the admin (`system:masters`) to `path`.
    pub fn kubeconfig_admin(&self, path: &Path) -> Result<()> {
        Ok(std::fs::write(path, self.kubeconfig_admin_text())?)
    }

    /// A client as admin (must run inside a tokio runtime; the harness's network
    /// namespace, if any, is the caller's business).
    pub async fn admin_client(&self) -> Client {
        client_from_kubeconfig(&self.kubeconfig_admin_text()).await.expect("an admin client")
    }

    /// Runs `f` with an admin client on a runtime of its own (inside the server's
    /// network namespace): for synchronous callers.
    pub fn with_admin<T: Send + 'static, F: Future<Output = Result<T>> + 'static>(&self, f: impl FnOnce(Client) -> F + Send + 'static) -> Result<T> {
        let cfg = self.kubeconfig_admin_text();
        on_own_runtime(self.opts.netns.clone(), move || async move { f(client_from_kubeconfig(&cfg).await?).await })
    }

    /// Like [`Self::with_admin`], for futures that borrow (`self`, the caller's data).
    pub fn block_on<T: Send, F: Future<Output = Result<T>>>(&self, f: impl FnOnce(Client) -> F + Send) -> Result<T> {
        let cfg = self.kubeconfig_admin_text();
        on_own_runtime(self.opts.netns.clone(), move || async move { f(client_from_kubeconfig(&cfg).await?).await })
    }

    /// Applies the CRDs of deploy/crd.yaml (VipPool, VipStatus) and waits until each is Established and served.
    pub async fn install_crd(&self, client: &Client) -> Result<()> {
        let docs = manifests(&deploy_dir().join("crd.yaml"))?;
        for doc in &docs {
            apply(client, doc, false).await?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for doc in &docs {
            let name = doc["metadata"]["name"].as_str().context("a CRD without a name")?;
            let served = format!(
                "/apis/{}/{}/{}",
                doc["spec"]["group"].as_str().unwrap_or(""),
                doc["spec"]["versions"][0]["name"].as_str().unwrap_or(""),
                doc["spec"]["names"]["plural"].as_str().unwrap_or("")
            );
            loop {
                let crd = raw(client, Method::GET, &format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"), "", None).await?.ok()?;
                let established =
                    crd["status"]["conditions"].as_array().is_some_and(|cs| cs.iter().any(|c| c["type"] == "Established" && c["status"] == "True"));
                // Established can come a moment before the resource is served: ask for it.
                if established && raw(client, Method::GET, &served, "", None).await?.status == 200 {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("the CRD {name} is not Established: {}", crd["status"]);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(())
    }

    /// Applies deploy/00-namespace.yaml and deploy/10-rbac.yaml, then asks the
    /// TokenRequest API for a token of ServiceAccount `namespace/name` (created if
    /// missing) and writes a kubeconfig with it to `path`: a client of it has exactly
    /// the rights deploy/10-rbac.yaml gives the agent. Returns the kubeconfig text.
    pub async fn service_account_kubeconfig(&self, client: &Client, namespace: &str, name: &str, path: &Path) -> Result<String> {
        for f in ["00-namespace.yaml", "10-rbac.yaml"] {
            for doc in manifests(&deploy_dir().join(f))? {
                apply(client, &doc, false).await?;
            }
        }
        ensure_namespace(client, namespace).await?;
        let sa = json!({ "apiVersion": "v1", "kind": "ServiceAccount", "metadata": { "name": name, "namespace": namespace } });
        let r = raw(client, Method::POST, &format!("/api/v1/namespaces/{namespace}/serviceaccounts"), "application/json", Some(&sa)).await?;
        if r.status != 409 {
            r.ok()?;
        }
        let req = json!({ "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": { "expirationSeconds": 3600 } });
        let tr =
            raw(client, Method::POST, &format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"), "application/json", Some(&req)).await?.ok()?;
        let token = tr["status"]["token"].as_str().ok_or_else(|| anyhow!("no token in {tr}"))?;
        let text = kubeconfig_text(&self.url, Some(&self.pki.ca.pem()), json!({ "token": token }), "vip-system");
        std::fs::write(path, &text)?;
        Ok(text)
    }

    /// SIGKILLs the API server (etcd stays): an outage.
    pub fn kill(&self) {
        if let Some(mut c) = self.procs.lock().unwrap().apiserver.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the API server again, on the same etcd and port, and waits until ready.
    pub fn restart(&self) -> Result<Duration> {
        self.kill();
        let t0 = Instant::now();
        self.spawn_apiserver()?;
        self.wait_ready(Duration::from_secs(60))?;
        Ok(t0.elapsed())
    }

    /// SIGKILLs etcd and the API server for good.
    pub fn stop(&self) {
        let mut p = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        for c in [p.apiserver.take(), p.etcd.take()].into_iter().flatten() {
            let mut c = c;
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for RealApiServer {
    fn drop(&mut self) {
        self.stop();
        // The TempDir field removes the directory.
    }
}

/// The last `lines` lines of a log file (empty if it cannot be read).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let mut s = String::new();
    let _ = File::open(path).and_then(|mut f| f.read_to_string(&mut s));
    let all: Vec<&str> = s.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Every YAML document of a file, as JSON (empty documents skipped).
pub fn manifests(path: &Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    documents(&text).with_context(|| path.display().to_string())
}

/// The objects of a multi-document YAML text.
pub fn documents(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v = Value::deserialize(doc)?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// What `kubectl apply -k dir` applies: `kubectl kustomize dir`, rendered by the
/// kubectl users have (kustomize is built into it).
pub fn kustomize(dir: &Path) -> Result<Vec<Value>> {
    let out = std::process::Command::new("kubectl").arg("kustomize").arg(dir).output().context("running kubectl kustomize (is kubectl installed?)")?;
    if !out.status.success() {
        bail!("kubectl kustomize {}: {}", dir.display(), String::from_utf8_lossy(&out.stderr));
    }
    documents(&String::from_utf8_lossy(&out.stdout)).with_context(|| format!("kubectl kustomize {}", dir.display()))
}

/// Creates namespace `name` unless it exists.
pub async fn ensure_namespace(client: &Client, name: &str) -> Result<()> {
    let ns = json!({ "apiVersion": "v1", "kind": "Namespace", "metadata": { "name": name } });
    let r = raw(client, Method::POST, "/api/v1/namespaces", "application/json", Some(&ns)).await?;
    if r.status != 409 {
        r.ok()?;
    }
    Ok(())
}

/// Discovery: (plural, namespaced) of `kind` in `apiVersion`.
pub async fn discover(client: &Client, api_version: &str, kind: &str) -> Result<(String, bool)> {
    let path = if api_version.contains('/') { format!("/apis/{api_version}") } else { format!("/api/{api_version}") };
    let list = raw(client, Method::GET, &path, "", None).await?.ok().with_context(|| format!("discovery of {api_version}"))?;
    let r = list["resources"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["kind"] == kind && !r["name"].as_str().unwrap_or("/").contains('/')))
        .ok_or_else(|| anyhow!("the server serves no {kind} in {api_version}"))?;
    Ok((r["name"].as_str().unwrap().to_owned(), r["namespaced"].as_bool().unwrap_or(false)))
}

/// Server-side apply of one object (field manager `vip-tests`, forced), optionally
/// as a dry run; fails on a rejection, returns the server's warnings.
pub async fn apply(client: &Client, doc: &Value, dry_run: bool) -> Result<Vec<String>> {
    let (api_version, kind) = (doc["apiVersion"].as_str().unwrap_or_default(), doc["kind"].as_str().unwrap_or_default());
    let name = doc["metadata"]["name"].as_str().ok_or_else(|| anyhow!("{kind} without a name"))?;
    let (plural, namespaced) = discover(client, api_version, kind).await?;
    let base = if api_version.contains('/') { format!("/apis/{api_version}") } else { format!("/api/{api_version}") };
    let path = if namespaced {
        let ns = doc["metadata"]["namespace"].as_str().unwrap_or("default");
        format!("{base}/namespaces/{ns}/{plural}/{name}")
    } else {
        format!("{base}/{plural}/{name}")
    };
    let query = if dry_run { "?fieldManager=vip-tests&force=true&dryRun=All" } else { "?fieldManager=vip-tests&force=true" };
    let r = raw(client, Method::PATCH, &format!("{path}{query}"), "application/apply-patch+yaml", Some(doc)).await?;
    let warnings = r.warnings.clone();
    r.ok().with_context(|| format!("applying {kind} {name}{}", if dry_run { " (dry run)" } else { "" }))?;
    Ok(warnings)
}

/// Serialises tests that share the one real server of a binary and touch
/// cluster-wide state (VipPools, the controller's Lease).
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Where a test body runs: the in-process stand-in or the real API server. Reads
/// are synchronous (the stand-in reads its store; for the real server they block
/// the calling worker, so use a multi-threaded runtime).
pub enum Backend {
    StandIn(ApiServer),
    Real { server: &'static RealApiServer, client: Client, _exclusive: MutexGuard<'static, ()> },
}

impl Backend {
    /// The stand-in serving what the agent uses.
    pub async fn stand_in() -> Self {
        Self::stand_in_with(Stack::V4).await
    }

    /// The stand-in as an IPv4-only or a dual-stack cluster.
    pub async fn stand_in_with(stack: Stack) -> Self {
        let b = ApiServer::builder().resources(ResourceSpec::VIP).bookmark_interval(Duration::from_millis(500)).stack(stack);
        Backend::StandIn(b.start().await.unwrap())
    }

    /// The binary's shared real server (`None`: skipped, see [`assets`]), emptied of
    /// what earlier tests left (VipPools, Services and Events, the controller's
    /// Lease), with the VipPool CRD and the namespaces `shop` and `vip-system`.
    pub async fn real() -> Option<Self> {
        Self::real_with(Stack::V4).await
    }

    /// [`Self::real`] of an IPv4-only or a dual-stack cluster ([`RealApiServer::shared_with`]).
    // The guard serialises tests (each on a runtime of its own) on the shared
    // servers for their whole run, awaits included: that is its purpose.
    #[allow(clippy::await_holding_lock)]
    pub async fn real_with(stack: Stack) -> Option<Self> {
        let guard = exclusive();
        let server = tokio::task::block_in_place(|| RealApiServer::shared_with(stack))?;
        let client = server.admin_client().await;
        server.install_crd(&client).await.expect("the VipPool CRD");
        for ns in ["shop", "vip-system"] {
            ensure_namespace(&client, ns).await.unwrap();
        }
        reset(&client).await.expect("emptying the real server");
        Some(Backend::Real { server, client, _exclusive: guard })
    }

    /// A new client for the test's own requests (after an API server restart).
    pub async fn reconnect(&mut self) {
        if let Backend::Real { server, client, .. } = self {
            *client = server.admin_client().await;
        }
    }

    pub fn is_real(&self) -> bool {
        matches!(self, Backend::Real { .. })
    }

    /// A new client (each agent of a test has its own).
    pub async fn client(&self) -> Client {
        match self {
            Backend::StandIn(api) => Client::try_from(kube::Config::new(api.url().parse().unwrap())).unwrap(),
            Backend::Real { server, .. } => server.admin_client().await,
        }
    }

    /// A client acting as ServiceAccount `namespace/name` under deploy/10-rbac.yaml:
    /// a TokenRequest token on the real server (the RBAC applied first, see
    /// [`RealApiServer::service_account_kubeconfig`]), the stand-in's token there.
    pub async fn service_account_client(&self, namespace: &str, name: &str) -> Client {
        match self {
            Backend::StandIn(_) => self.client_with_token(&crate::apiserver::service_account_token(namespace, name)).await,
            Backend::Real { server, client, .. } => {
                let tmp = TempDir::new("vip-sa-").unwrap();
                client_from_kubeconfig(&server.service_account_kubeconfig(client, namespace, name, &tmp.0.join("kubeconfig")).await.unwrap()).await.unwrap()
            }
        }
    }

    /// A client that sends `token` as its bearer token.
    pub async fn client_with_token(&self, token: &str) -> Client {
        let text = match self {
            Backend::StandIn(api) => kubeconfig_text(&api.url(), None, json!({ "token": token }), "vip-system"),
            Backend::Real { server, .. } => kubeconfig_text(server.url(), Some(&server.ca().pem()), json!({ "token": token }), "vip-system"),
        };
        client_from_kubeconfig(&text).await.unwrap()
    }

    fn block<T>(f: impl Future<Output = T>) -> T {
        tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
    }

    pub fn get(&self, resource: &str, ns: Option<&str>, name: &str) -> Option<Value> {
        match self {
            Backend::StandIn(api) => api.get(resource, ns, name),
            Backend::Real { client, .. } => {
                let r = Self::block(raw(client, Method::GET, &format!("{}/{name}", resource_path(resource, ns)), "", None)).unwrap();
                match r.status {
                    404 => None,
                    _ => Some(r.ok().unwrap()),
                }
            }
        }
    }

    pub fn list(&self, resource: &str, ns: Option<&str>) -> Vec<Value> {
        match self {
            Backend::StandIn(api) => api.list(resource, ns),
            Backend::Real { client, .. } => {
                let l = Self::block(raw(client, Method::GET, &resource_path(resource, ns), "", None)).unwrap().ok().unwrap();
                l["items"].as_array().cloned().unwrap_or_default()
            }
        }
    }

    /// Stores `obj` as it is (the stand-in) or applies it (the real server).
    pub fn insert(&self, resource: &str, obj: Value) -> Result<Value> {
        match self {
            Backend::StandIn(api) => api.insert(resource, obj).map_err(|e| anyhow!("{e:?}")),
            Backend::Real { client, .. } => {
                Self::block(apply(client, &obj, false))?;
                let ns = obj["metadata"]["namespace"].as_str();
                self.get(resource, ns, obj["metadata"]["name"].as_str().unwrap_or_default()).ok_or_else(|| anyhow!("applied but not there"))
            }
        }
    }
}

/// Deletes what controller tests leave on a real server.
async fn reset(client: &Client) -> Result<()> {
    let del = |path: String| async move {
        let r = raw(client, Method::DELETE, &path, "", None).await?;
        if r.status != 404 {
            r.ok()?;
        }
        anyhow::Ok(())
    };
    for (list, _) in [
        ("/apis/vip.dev/v1alpha1/vippools", ()),
        ("/apis/vip.dev/v1alpha1/vipstatuses", ()),
        ("/api/v1/services", ()),
        ("/apis/events.k8s.io/v1/events", ()),
        ("/apis/coordination.k8s.io/v1/leases", ()),
    ] {
        let items = raw(client, Method::GET, list, "", None).await?.ok()?;
        for it in items["items"].as_array().cloned().unwrap_or_default() {
            let (ns, name) = (it["metadata"]["namespace"].as_str(), it["metadata"]["name"].as_str().unwrap_or_default());
            // Only what tests make: not the API server's own (default/kubernetes,
            // kube-system leases).
            if matches!(ns, Some("default" | "kube-system" | "kube-node-lease")) && !list.contains("events") {
                continue;
            }
            let base = list.rsplit_once('/').unwrap();
            let path = match ns {
                Some(ns) => format!("{}/namespaces/{ns}/{}/{name}", base.0, base.1),
                None => format!("{list}/{name}"),
            };
            del(path).await?;
        }
    }
    Ok(())
}
