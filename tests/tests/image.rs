//! The OCI archives `cargo xtask image` writes (`target/images/*.oci.tar`), read
//! the way a runtime reads them: index → manifest → config and layer, every digest
//! and size checked, and the layer holding the entrypoint and exactly the shared
//! objects its ELF files need (no shell, nothing else). And the test pod program's
//! modes, run as a process: pause, echo, HTTP, SIGTERM, reaping as PID 1.
use std::{
    collections::{BTreeMap, BTreeSet},
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;
use sha2::{Digest as _, Sha256};
use vip_tests::{
    agent::{wait_for, TempDir},
    netns::{privileged, NetNs},
};

fn images_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images")
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

type Files = BTreeMap<String, (u32, Vec<u8>)>;

/// The regular files of a tar (name → mode and contents) and its directories; every
/// entry owned by root, nothing else (no links, no devices).
fn untar(data: &[u8]) -> (Files, BTreeSet<String>) {
    let (mut files, mut dirs) = (BTreeMap::new(), BTreeSet::new());
    let mut archive = tar::Archive::new(data);
    for entry in archive.entries().expect("tar entries") {
        let mut e = entry.expect("tar entry");
        let name = e.path().expect("entry path").to_string_lossy().into_owned();
        let h = e.header();
        assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0), "{name}: owner must be root");
        let mode = h.mode().unwrap();
        match h.entry_type() {
            tar::EntryType::Regular => {
                let mut body = Vec::new();
                e.read_to_end(&mut body).unwrap();
                assert!(files.insert(name.clone(), (mode, body)).is_none(), "{name} twice");
            }
            tar::EntryType::Directory => {
                dirs.insert(name.trim_end_matches('/').to_owned());
            }
            other => panic!("{name}: unexpected tar entry type {other:?}"),
        }
    }
    (files, dirs)
}

/// Every file's parent directories have entries of their own (as `tar` writes them).
fn check_dirs(files: &Files, dirs: &BTreeSet<String>, what: &str) {
    for f in files.keys() {
        let mut p = Path::new(f).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            assert!(dirs.contains(d.to_str().unwrap()), "{what}: {f}: its directory {} has no entry", d.display());
            p = d.parent();
        }
    }
}

fn json(bytes: &[u8], what: &str) -> Value {
    serde_json::from_slice(bytes).unwrap_or_else(|e| panic!("{what} is not JSON: {e}"))
}

/// The blob a descriptor names, with its media type, digest and size checked.
fn blob<'a>(outer: &'a Files, desc: &Value, media_types: &[&str]) -> &'a [u8] {
    assert!(media_types.iter().any(|m| desc["mediaType"] == *m), "descriptor {desc}: not a {media_types:?}");
    let digest = desc["digest"].as_str().expect("digest");
    let name = format!("blobs/sha256/{}", digest.strip_prefix("sha256:").expect("sha256 digest"));
    let (_, body) = outer.get(&name).unwrap_or_else(|| panic!("{name} missing from the archive"));
    assert_eq!(sha256(body), digest, "{name}: content does not match its digest");
    assert_eq!(desc["size"].as_u64(), Some(body.len() as u64), "{name}: size");
    body
}

/// One image read from an OCI image layout (the files of its tar) as a runtime
/// reads it: index → manifest → config and layers, every digest and size checked.
struct Image {
    /// The index's descriptor of the manifest.
    desc: Value,
    manifest: Value,
    config: Value,
    /// Uncompressed, each matching its diff_id.
    layers: Vec<Vec<u8>>,
}

fn read_image(outer: &Files, what: &str) -> Image {
    let file = |name: &str| &outer.get(name).unwrap_or_else(|| panic!("{what}: no {name}")).1;
    assert_eq!(json(file("oci-layout"), "oci-layout")["imageLayoutVersion"], "1.0.0");
    for (name, (_, body)) in outer.iter().filter(|(n, _)| n.starts_with("blobs/")) {
        assert_eq!(sha256(body), name.replacen("blobs/sha256/", "sha256:", 1), "{what}: {name}: content does not match its name");
    }
    let index = json(file("index.json"), "index.json");
    assert_eq!(index["schemaVersion"], 2);
    let manifests = index["manifests"].as_array().expect("index.manifests");
    assert_eq!(manifests.len(), 1, "{what}: one image per archive");
    let desc = manifests[0].clone();
    let manifest = json(blob(outer, &desc, &["application/vnd.oci.image.manifest.v1+json"]), "the manifest");
    assert_eq!(manifest["schemaVersion"], 2);
    let config = json(blob(outer, &manifest["config"], &["application/vnd.oci.image.config.v1+json"]), "the config");
    let media = ["application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.oci.image.layer.v1.tar"];
    let layers: Vec<Vec<u8>> = (manifest["layers"].as_array().expect("manifest.layers").iter())
        .map(|d| {
            let body = blob(outer, d, &media);
            if d["mediaType"] == media[1] {
                return body.to_vec();
            }
            let mut layer = Vec::new();
            flate2::read::GzDecoder::new(body).read_to_end(&mut layer).expect("the layer is gzip");
            layer
        })
        .collect();
    let diff_ids: Vec<_> = layers.iter().map(|l| sha256(l)).collect();
    assert_eq!(config["rootfs"]["diff_ids"], serde_json::json!(diff_ids), "{what}: diff_ids of the uncompressed layers");
    Image { desc, manifest, config, layers }
}

/// The loader's search directories for this machine's multiarch triple.
fn library_dirs() -> Vec<String> {
    let triple = format!("{}-linux-gnu", std::env::consts::ARCH);
    vec![format!("lib/{triple}"), format!("usr/lib/{triple}"), "lib".into(), "usr/lib".into(), "lib64".into(), "usr/lib64".into()]
}

/// PT_INTERP and DT_NEEDED of an ELF file (None if it is not an ELF file).
fn elf_needs(data: &[u8]) -> Option<(Option<String>, Vec<String>)> {
    use object::{
        elf,
        read::elf::{Dyn as _, ElfFile64, FileHeader as _, ProgramHeader as _, SectionHeader as _},
        Endianness,
    };
    let file = ElfFile64::<Endianness>::parse(data).ok()?;
    let (endian, header) = (file.endian(), file.elf_header());
    let mut interp = None;
    let mut needed = Vec::new();
    for ph in header.program_headers(endian, data).unwrap() {
        if ph.p_type(endian) == elf::PT_INTERP {
            let raw = ph.data(endian, data).unwrap();
            interp = Some(String::from_utf8_lossy(raw.split(|&b| b == 0).next().unwrap()).into_owned());
        }
    }
    let sections = header.sections(endian, data).unwrap();
    for s in sections.iter() {
        if let Some((dynamic, link)) = s.dynamic(endian, data).unwrap() {
            let strings = sections.strings(endian, data, link).unwrap();
            for d in dynamic {
                if d.tag32(endian) == Some(elf::DT_NEEDED as i32) {
                    needed.push(String::from_utf8_lossy(d.string(endian, strings).unwrap()).into_owned());
                }
            }
        }
    }
    Some((interp, needed))
}

/// The image this machine's container runtime runs (OCI platform names).
fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// Checks one archive; returns it and its layer's files (path without the leading '/').
fn check_archive(file: &str, reference: &str, entrypoint: &str) -> (Image, Files) {
    let path = images_dir().join(file);
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}; write it with `cargo xtask image` (cargo xtask test does)", path.display()));
    let (outer, dirs) = untar(&data);
    check_dirs(&outer, &dirs, file);
    let image = read_image(&outer, file);
    let Image { desc, manifest, config, layers } = &image;
    let tag = reference.rsplit_once(':').unwrap().1;
    assert_eq!(desc["annotations"]["io.containerd.image.name"], reference, "what `ctr images import` names it");
    assert_eq!(desc["annotations"]["org.opencontainers.image.ref.name"], tag);
    assert_eq!(desc["platform"], serde_json::json!({"architecture": architecture(), "os": "linux"}));
    assert_eq!(layers.len(), 1, "one layer");
    assert_eq!(manifest["layers"][0]["mediaType"], "application/vnd.oci.image.layer.v1.tar+gzip");
    assert_eq!((&config["architecture"], &config["os"]), (&desc["platform"]["architecture"], &desc["platform"]["os"]));
    assert_eq!(config["config"]["Entrypoint"], serde_json::json!([entrypoint]));

    // Labels and annotations: the same set, with what a registry and a reader expect.
    let labels = &config["config"]["Labels"];
    assert_eq!(labels, &manifest["annotations"], "config labels and manifest annotations");
    let label = |k: &str| labels[format!("org.opencontainers.image.{k}")].as_str().unwrap_or_else(|| panic!("label {k} missing: {labels}")).to_owned();
    assert_eq!(label("version"), env!("CARGO_PKG_VERSION"));
    assert_eq!(label("licenses"), env!("CARGO_PKG_LICENSE"));
    assert!(!label("title").is_empty());
    let created = label("created");
    assert_eq!(config["created"], created.as_str());
    assert!(created.len() == 20 && created.ends_with('Z') && created.as_bytes()[10] == b'T', "created {created:?}: RFC 3339 UTC");
    if Command::new("git").args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "HEAD"]).output().is_ok_and(|o| o.status.success()) {
        let rev = label("revision");
        assert!(rev.trim_end_matches("-dirty").len() >= 40, "revision {rev:?}: a full commit id");
    }

    // The layer: the entrypoint, and exactly the shared objects the ELF files in it
    // need, each where the loader looks (PT_INTERP's path, DT_NEEDED in the lib dirs).
    let (files, dirs) = untar(&layers[0]);
    check_dirs(&files, &dirs, "the layer");
    let entry = entrypoint.trim_start_matches('/');
    let (mode, _) = files.get(entry).unwrap_or_else(|| panic!("the entrypoint {entrypoint} is not in the layer: {:?}", files.keys()));
    assert_eq!(mode & 0o111, 0o111, "{entrypoint} is executable");
    let mut wanted = BTreeSet::from([entry.to_owned()]);
    let mut todo = vec![entry.to_owned()];
    while let Some(f) = todo.pop() {
        let (interp, needed) = elf_needs(&files[&f].1).unwrap_or_else(|| panic!("{f} is not an ELF file"));
        let interp = interp.map(|i| i.trim_start_matches('/').to_owned());
        let mut found = Vec::new();
        if let Some(i) = &interp {
            assert!(files.contains_key(i), "{f}: its interpreter /{i} is not in the layer");
            found.push(i.clone());
        }
        for lib in needed {
            // The loader itself, named by soname, is satisfied by PT_INTERP.
            if interp.as_deref().is_some_and(|i| i.ends_with(&format!("/{lib}"))) {
                continue;
            }
            let at = library_dirs().into_iter().map(|d| format!("{d}/{lib}")).find(|p| files.contains_key(p));
            found.push(at.unwrap_or_else(|| panic!("{f} needs {lib}, which is in none of {:?}", library_dirs())));
        }
        for p in found {
            if wanted.insert(p.clone()) {
                todo.push(p);
            }
        }
    }
    let extra: Vec<_> = files.keys().filter(|f| !wanted.contains(*f)).collect();
    assert!(extra.is_empty(), "files no ELF in the image needs: {extra:?}");
    assert!(!files.contains_key("bin/sh"), "no shell");
    (image, files)
}

#[test]
fn agent_archive() {
    let (_, files) = check_archive("vip-agent.oci.tar", &format!("localhost/vip-agent:{}", env!("CARGO_PKG_VERSION")), "/usr/local/bin/vip-agent");
    // The XDP object is embedded: a second ELF header, for EM_BPF (247).
    let agent = &files["usr/local/bin/vip-agent"].1;
    assert!(agent.windows(20).skip(1).any(|w| w[..4] == *b"\x7fELF" && u16::from_le_bytes([w[18], w[19]]) == 247), "no BPF object inside the agent");
}

#[test]
fn testpod_archive() {
    check_archive("vip-testpod.oci.tar", "localhost/vip-testpod:1", "/vip-testpod");
}

/// Whether `podman` runs here; outside CI its absence skips (printed), with
/// `CI=true` it fails (`cargo xtask setup` installs it).
fn have_podman() -> bool {
    if Command::new("podman").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("CI=true but podman does not run: the Containerfile test must run in CI (`cargo xtask setup` installs it)");
    }
    eprintln!("skipping: no podman (Debian package podman) to build deploy/Containerfile");
    false
}

/// podman with a storage of its own in a temporary directory: the machine's
/// images, containers and events are neither read nor written. podman as root
/// keeps a blob cache in /var/lib/containers/cache whatever its storage, so it
/// runs in a mount namespace of its own with an empty tmpfs on /var/lib.
struct Podman(TempDir);

impl Podman {
    fn new() -> Self {
        Self(TempDir::new("vip-podman-").unwrap())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0 .0.join(name)
    }

    /// Runs `podman ARGS`, failing with its output unless it succeeds; its stdout.
    fn run(&self, args: &[&str]) -> String {
        let dir = |d: &str| self.path(d).to_str().unwrap().to_owned();
        let mut c = Command::new("unshare");
        c.args(["--mount", "--", "sh", "-c", r#"mount -t tmpfs -o size=16m vip-podman /var/lib && mkdir /var/lib/containers && exec "$@""#, "sh"]);
        c.args(["podman", "--root", &dir("root"), "--runroot", &dir("run"), "--tmpdir", &dir("tmp"), "--storage-driver", "vfs"]);
        c.args(["--events-backend", "none", "--cgroup-manager", "cgroupfs"]).args(args).env("TMPDIR", dir("tmp"));
        std::fs::create_dir_all(dir("tmp")).unwrap();
        let o = c.output().unwrap();
        let stdout = String::from_utf8_lossy(&o.stdout).into_owned();
        assert!(o.status.success(), "podman {args:?} failed ({}):\n{stdout}{}", o.status, String::from_utf8_lossy(&o.stderr));
        stdout
    }
}

/// deploy/Containerfile, built by podman from the tree `cargo xtask image` writes
/// beside the archive, makes the archive's image: the same files (paths, modes,
/// contents) and directories, the same entrypoint, environment, working directory,
/// platform and time, and every label the archive has, with its value. And
/// `podman load` takes the archive under its name.
#[test]
fn containerfile_builds_the_archive_image() {
    if !privileged() || !have_podman() {
        return;
    }
    let (archive, files) = check_archive("vip-agent.oci.tar", &format!("localhost/vip-agent:{}", env!("CARGO_PKG_VERSION")), "/usr/local/bin/vip-agent");
    let (_, dirs) = untar(&archive.layers[0]);
    let rootfs = images_dir().join("vip-agent.rootfs");
    assert!(rootfs.is_dir(), "{}: missing; `cargo xtask image` writes it", rootfs.display());
    let labels = archive.config["config"]["Labels"].as_object().expect("labels");
    let label = |k: &str| labels.get(&format!("org.opencontainers.image.{k}")).and_then(Value::as_str).unwrap_or_default().to_owned();
    // The archive's file time (the commit's), for podman's files and image.
    let mut layer = tar::Archive::new(archive.layers[0].as_slice());
    let mtime = layer.entries().unwrap().next().expect("a file").unwrap().header().mtime().unwrap().to_string();
    let containerfile = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/Containerfile");
    let args = [("VERSION", "version"), ("REVISION", "revision"), ("CREATED", "created"), ("SOURCE", "source")].map(|(a, k)| format!("{a}={}", label(k)));

    let podman = Podman::new();
    let mut build = vec![
        "build",
        "--pull=never",
        "--network=none",
        "-f",
        containerfile.to_str().unwrap(),
        "--timestamp",
        &mtime,
        "-t",
        "localhost/vip-agent:containerfile",
    ];
    for a in &args {
        build.extend(["--build-arg", a]);
    }
    build.push(rootfs.to_str().unwrap());
    podman.run(&build);
    let saved = podman.path("saved.tar");
    podman.run(&["save", "--format", "oci-archive", "-o", saved.to_str().unwrap(), "localhost/vip-agent:containerfile"]);
    let (outer, _) = untar(&std::fs::read(&saved).unwrap());
    let built = read_image(&outer, "podman save");

    assert_eq!(built.layers.len(), 1, "COPY makes the only layer");
    let (built_files, built_dirs) = untar(&built.layers[0]);
    let summary = |f: &Files| f.iter().map(|(name, (mode, body))| (name.clone(), mode & 0o7777, sha256(body))).collect::<Vec<_>>();
    assert_eq!(summary(&built_files), summary(&files), "the files: path, mode, sha256");
    assert_eq!(built_dirs, dirs, "the directories");

    let (a, b) = (&archive.config, &built.config);
    for k in ["architecture", "os", "created"] {
        assert_eq!(b[k], a[k], "config {k}");
    }
    for k in ["Entrypoint", "Cmd", "Env", "WorkingDir"] {
        assert_eq!(b["config"][k], a["config"][k], "config.config {k}");
    }
    for (k, v) in labels {
        assert_eq!(&b["config"]["Labels"][k], v, "label {k}");
    }

    // `podman load` of the archive (as docs/install/image.md says) names it as `ctr` does.
    let reference = format!("localhost/vip-agent:{}", env!("CARGO_PKG_VERSION"));
    podman.run(&["load", "-i", images_dir().join("vip-agent.oci.tar").to_str().unwrap()]);
    let id = podman.run(&["image", "inspect", "--format", "{{.Id}}", &reference]);
    assert_eq!(format!("sha256:{}", id.trim()), archive.manifest["config"]["digest"].as_str().unwrap(), "the image podman loaded as {reference}");
}

/// vip-testpod as a child process, killed on Drop.
struct Pod(Child);

impl Drop for Pod {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Pod {
    fn terminate(&mut self) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        wait_for(Duration::from_secs(10), || self.0.try_wait().unwrap()).expect("vip-testpod did not exit within 10 s of SIGTERM")
    }
}

#[test]
fn testpod_serves_echo_and_http_and_stops_on_sigterm() {
    if !privileged() {
        return;
    }
    let ns = NetNs::new("vtp").unwrap();
    let mut pod = Pod(ns
        .cmd(env!("CARGO_BIN_EXE_vip-testpod"))
        .args(["serve", "--bind", "127.0.0.1", "--port", "0", "--port", "0", "--http-port", "0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap());
    let mut out = BufReader::new(pod.0.stdout.take().unwrap());
    let mut addrs = Vec::new();
    for _ in 0..3 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let (kind, addr) = line.trim().split_once(' ').unwrap_or_else(|| panic!("listener line {line:?}"));
        addrs.push((kind.to_owned(), addr.parse::<SocketAddr>().unwrap()));
    }
    assert_eq!(addrs.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["echo", "echo", "http"]);
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_owned();
    ns.run(move || {
        for (_, addr) in &addrs[..2] {
            let s = TcpStream::connect_timeout(addr, Duration::from_secs(5)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut r = BufReader::new(s.try_clone().unwrap());
            let mut greeting = String::new();
            r.read_line(&mut greeting).unwrap();
            assert_eq!(greeting, format!("{host} {}\n", s.local_addr().unwrap()));
            // Several lines on one connection, each back as sent.
            for msg in ["first\n", "second line\n", "\n"] {
                (&s).write_all(msg.as_bytes()).unwrap();
                let mut back = String::new();
                r.read_line(&mut back).unwrap();
                assert_eq!(back, msg);
            }
        }
        let http = |request: &str| {
            let mut s = TcpStream::connect_timeout(&addrs[2].1, Duration::from_secs(5)).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            let mut reply = String::new();
            s.read_to_string(&mut reply).unwrap();
            reply
        };
        let ok = http("GET / HTTP/1.1\r\nHost: pod\r\nUser-Agent: test\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with(&format!("\r\n\r\n{host}\n")), "GET /: {ok:?}");
        let no = http("POST / HTTP/1.1\r\nHost: pod\r\n\r\n");
        assert!(no.starts_with("HTTP/1.1 405 "), "POST /: {no:?}");
    })
    .unwrap();
    assert_eq!(pod.terminate().code(), Some(0), "serve exits 0 on SIGTERM");
}

/// The pause mode as PID 1 of a PID namespace: it reaps the orphans the kernel
/// gives it, and exits 0 on SIGTERM.
#[test]
fn testpod_pause_reaps_orphans_and_stops_on_sigterm() {
    if !privileged() {
        return;
    }
    // unshare forks vip-testpod as PID 1 of a new PID namespace (and kills it if
    // unshare dies); the init's pid on this side is unshare's only child.
    let mut pod = Pod(Command::new("unshare").args(["--pid", "--fork", "--kill-child", env!("CARGO_BIN_EXE_vip-testpod")]).spawn().unwrap());
    let children = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    let init: u32 = wait_for(Duration::from_secs(5), || children(pod.0.id()).split_whitespace().next()?.parse().ok()).expect("unshare's child");
    // A shell in that namespace leaves a short-lived orphan, which goes to init.
    let st = Command::new("nsenter").args(["-t", &init.to_string(), "--pid", "--", "sh", "-c", "sleep 0.2 & exit 0"]).status().unwrap();
    assert!(st.success());
    let zombie_free = wait_for(Duration::from_secs(5), || {
        let kids = children(init);
        let zombies = kids.split_whitespace().filter(|k| {
            std::fs::read_to_string(format!("/proc/{k}/stat")).is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| r.trim_start().starts_with('Z')))
        });
        (kids.split_whitespace().count() == 0 && zombies.count() == 0).then_some(())
    });
    // Without reaping, the sleep stays a zombie child of init: this would fail.
    assert!(zombie_free.is_some(), "the orphan was not reaped: children of init {}", children(init));
    // SAFETY: kill(2) on a process this test started (init of its namespace).
    unsafe { libc::kill(init as i32, libc::SIGTERM) };
    let st = wait_for(Duration::from_secs(10), || pod.0.try_wait().unwrap()).expect("pause did not exit within 10 s of SIGTERM");
    assert_eq!(st.code(), Some(0), "unshare passes on init's exit status");
}
