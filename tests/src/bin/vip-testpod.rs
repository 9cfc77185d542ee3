//! The one program of the cluster tests' image (`localhost/vip-testpod:1`, written
//! by `cargo xtask image`), std and libc only:
//!
//! - no arguments: a pause process, fit to be containerd's sandbox image: as PID 1
//!   it reaps adopted children and exits 0 at once on SIGTERM or SIGINT;
//! - `serve [--bind ADDR] --port P [--port Q ...] [--http-port H ...]`: TCP servers
//!   that greet each connection with one line `<hostname> <peer address>` and then
//!   echo every line back until the client closes (long-lived connections), and
//!   optionally HTTP servers;
//! - `http [--bind ADDR] --port P [--port Q ...]`: HTTP servers only, answering every
//!   `GET` with 200 and `<hostname>` (for probes and kube-proxy-like checks).
//!
//! Each listener prints `<kind> <address>` on stdout once bound (port 0 picks one).
//! Connections are served on threads, at most [`MAX_CONNECTIONS`] at once (more are
//! closed at once); every mode exits 0 on SIGTERM or SIGINT.
use std::{
    io::{BufRead, BufReader, Read as _, Write as _},
    net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::Duration,
};

const USAGE: &str = "usage: vip-testpod                      (pause: reap children, exit on SIGTERM/SIGINT)
       vip-testpod serve [--bind ADDR] --port P [--port Q ...] [--http-port H ...]
       vip-testpod http [--bind ADDR] --port P [--port Q ...]";

/// Connections served at once; beyond that new ones are closed.
const MAX_CONNECTIONS: usize = 512;
/// The longest line echoed in one piece (longer lines come back in pieces).
const MAX_LINE: u64 = 64 * 1024;

#[derive(Debug, PartialEq)]
struct Listen {
    bind: IpAddr,
    echo: Vec<u16>,
    http: Vec<u16>,
}

/// None: the pause process.
fn parse(args: &[String]) -> Result<Option<Listen>, String> {
    let Some((mode, rest)) = args.split_first() else { return Ok(None) };
    let http_only = match mode.as_str() {
        "serve" => false,
        "http" => true,
        other => return Err(format!("unknown mode {other:?}")),
    };
    let mut l = Listen { bind: Ipv4Addr::UNSPECIFIED.into(), echo: vec![], http: vec![] };
    let mut it = rest.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag}: needs a value"))?;
        let port = || value.parse::<u16>().map_err(|_| format!("{flag}: {value:?} is not a port (0-65535)"));
        match flag.as_str() {
            "--bind" => l.bind = value.parse().map_err(|_| format!("--bind: {value:?} is not an IP address"))?,
            "--port" if http_only => l.http.push(port()?),
            "--port" => l.echo.push(port()?),
            "--http-port" if !http_only => l.http.push(port()?),
            other => return Err(format!("unknown option {other:?} for {mode}")),
        }
    }
    if l.echo.is_empty() && l.http.is_empty() {
        return Err(format!("{mode}: give at least one --port"));
    }
    Ok(Some(l))
}

fn main() {
    // Blocked here, before any thread starts, so that every thread inherits the
    // mask and the main thread alone takes these signals with sigwait.
    let signals = signal_set(&[libc::SIGTERM, libc::SIGINT, libc::SIGCHLD]);
    // SAFETY: a valid, initialised set; no other thread exists yet.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &signals, std::ptr::null_mut()) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "-h" || a == "--help") {
        println!("{USAGE}");
        return;
    }
    match parse(&args) {
        Ok(None) => {}
        Ok(Some(l)) => {
            if let Err(e) = listen(&l) {
                eprintln!("vip-testpod: {e}");
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("vip-testpod: {e}\n{USAGE}");
            std::process::exit(2);
        }
    }
    wait_for_signals(&signals)
}

fn signal_set(signals: &[i32]) -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set before sigaddset reads it.
    unsafe {
        let mut set = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Reaps children (PID 1 adopts orphans) until SIGTERM or SIGINT, then exits 0.
fn wait_for_signals(set: &libc::sigset_t) -> ! {
    loop {
        let mut sig = 0;
        // SAFETY: a valid set, blocked in every thread.
        if unsafe { libc::sigwait(set, &mut sig) } != 0 {
            continue;
        }
        match sig {
            libc::SIGCHLD => {
                // One SIGCHLD may stand for several children.
                // SAFETY: no pointers passed.
                while unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) } > 0 {}
            }
            _ => std::process::exit(0),
        }
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer and its length match.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Binds every port, announces it on stdout and serves it on a thread of its own.
fn listen(l: &Listen) -> std::io::Result<()> {
    let host: Arc<str> = hostname().into();
    let active = Arc::new(AtomicUsize::new(0));
    let kinds = l.echo.iter().map(|&p| ("echo", p, echo as fn(TcpStream, &str) -> std::io::Result<()>)).chain(l.http.iter().map(|&p| ("http", p, http as _)));
    for (kind, port, serve) in kinds {
        let listener =
            TcpListener::bind(SocketAddr::new(l.bind, port)).map_err(|e| std::io::Error::new(e.kind(), format!("{kind} port {port} on {}: {e}", l.bind)))?;
        println!("{kind} {}", listener.local_addr()?);
        let (host, active) = (host.clone(), active.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                    active.fetch_sub(1, Ordering::SeqCst);
                    continue; // dropped: closed
                }
                let (host, active) = (host.clone(), active.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &host);
                    active.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
    }
    std::io::stdout().flush()
}

/// `<hostname> <peer>` then every line received, back, until the client closes.
fn echo(stream: TcpStream, host: &str) -> std::io::Result<()> {
    let mut out = stream.try_clone()?;
    writeln!(out, "{host} {}", stream.peer_addr()?)?;
    let mut input = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        if input.by_ref().take(MAX_LINE).read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        out.write_all(&line)?;
    }
}

/// One request per connection: any `GET` gets 200 and the hostname.
fn http(stream: TcpStream, host: &str) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut out = stream.try_clone()?;
    let mut input = BufReader::new(stream).take(16 * 1024);
    let mut request = String::new();
    input.read_line(&mut request)?;
    // The headers, up to the blank line (bounded by `take`).
    let mut header = String::new();
    while input.read_line(&mut header)? > 0 && !header.trim().is_empty() {
        header.clear();
    }
    let (status, body) = if request.starts_with("GET ") { ("200 OK", format!("{host}\n")) } else { ("405 Method Not Allowed", "GET only\n".to_owned()) };
    write!(out, "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn modes_and_their_errors() {
        assert_eq!(parse(&[]), Ok(None));
        let l = parse(&args("serve --bind 127.0.0.1 --port 80 --port 81 --http-port 8080")).unwrap().unwrap();
        assert_eq!((l.bind, l.echo, l.http), (IpAddr::from([127, 0, 0, 1]), vec![80, 81], vec![8080]));
        let l = parse(&args("http --port 8080")).unwrap().unwrap();
        assert_eq!((l.echo, l.http), (vec![], vec![8080]));
        assert_eq!(parse(&args("serve --port 70000")), Err("--port: \"70000\" is not a port (0-65535)".into()));
        assert_eq!(parse(&args("serve --bind nowhere --port 1")), Err("--bind: \"nowhere\" is not an IP address".into()));
        assert_eq!(parse(&args("serve")), Err("serve: give at least one --port".into()));
        assert_eq!(parse(&args("serve --port")), Err("--port: needs a value".into()));
        assert_eq!(parse(&args("http --http-port 1")), Err("unknown option \"--http-port\" for http".into()));
        assert_eq!(parse(&args("sleep")), Err("unknown mode \"sleep\"".into()));
    }
}
