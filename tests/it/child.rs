//! `koder-dns serve` as a child process: started on ephemeral loopback ports, its addresses
//! read from its log, killed when dropped. For the tests that need the real binary (restarts,
//! signals, the deploy files, the agent).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The key every child server is started with.
pub const KEY: &str = "restart-test-key-0123456789abcdef";

/// A running `koder-dns serve`; killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    pub dns: SocketAddr,
    pub http: SocketAddr,
    /// Whether `http` serves HTTPS (started with a certificate).
    pub https: bool,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

pub enum Started {
    Up(Proc),
    Exited { status: ExitStatus, stderr: String },
}

pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // CSI: parameters and intermediates, then one final byte in @..~.
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

/// `name=ADDR` in a (de-coloured) tracing text line, or `"name":"ADDR"` in a JSON one,
/// tolerating quotes and punctuation.
pub fn field(line: &str, name: &str) -> Option<SocketAddr> {
    let (text, json) = (format!("{name}="), format!("\"{name}\":"));
    line.split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}')
        .filter_map(|token| token.strip_prefix(&text).or_else(|| token.strip_prefix(&json)))
        .map(|value| value.trim_matches(|c: char| c == '"' || c == '\'' || c == ';'))
        .find_map(|value| value.parse().ok())
}

pub fn command(data: &Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_koder-dns"));
    cmd.arg("serve")
        .args(["--dns-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data)
        .arg("--zones-dir")
        .arg(data.join("zones"))
        .args(extra)
        .env("KODER_DNS_API_KEY", KEY)
        .env("NO_COLOR", "1")
        .env("KODER_DNS_LOG", "info")
        .env_remove("KODER_DNS_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

/// Starts the binary; returns once it listens and `/healthz` answers 200, or once it exits.
pub async fn launch(data: &Path, extra: &[&str]) -> Started {
    launch_command(command(data, extra)).await
}

/// [`launch`] for a command built with [`command`] and then changed (its environment, say).
pub async fn launch_command(mut cmd: Command) -> Started {
    let mut child = cmd.spawn().expect("spawn koder-dns");
    let stderr = child.stderr.take().expect("piped stderr");
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let plain = strip_ansi(&line);
                if plain.contains("koder-dns listening") {
                    let https = plain.contains("https=true") || plain.contains("\"https\":true");
                    let _ = tx.send((field(&plain, "dns"), field(&plain, "http"), https, plain.clone()));
                }
                let mut log = log.lock().unwrap();
                log.push_str(&plain);
                log.push('\n');
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (dns, http, https) = loop {
        if let Ok((dns, http, https, line)) = rx.try_recv() {
            match (dns, http) {
                (Some(dns), Some(http)) => break (dns, http, https),
                _ => panic!("cannot parse the addresses from the log line {line:?}"),
            }
        }
        if let Some(status) = child.try_wait().expect("try_wait") {
            let _ = reader.join();
            let stderr = log.lock().unwrap().clone();
            return Started::Exited { status, stderr };
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!(
                "koder-dns did not log `koder-dns listening` within 20s; stderr:\n{}",
                log.lock().unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let proc = Proc {
        child,
        dns,
        http,
        https,
        log,
        reader: Some(reader),
    };
    // Whether it is up, not whom it is: the tests that serve HTTPS check the certificate.
    let client = crate::common::http_builder()
        .timeout(Duration::from_secs(2))
        .tls_danger_accept_invalid_certs(true)
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(r) = client.get(format!("{}/healthz", proc.base())).send().await
            && r.status() == 200
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "/healthz did not answer 200 within 10s; stderr:\n{}",
            proc.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Started::Up(proc)
}

pub async fn launch_ok(data: &Path, extra: &[&str]) -> Proc {
    match launch(data, extra).await {
        Started::Up(proc) => proc,
        Started::Exited { status, stderr } => panic!("koder-dns exited at start with {status}; stderr:\n{stderr}"),
    }
}

/// Starts the binary and expects it to refuse: returns its exit status and stderr.
pub async fn launch_refused(data: &Path, extra: &[&str]) -> (ExitStatus, String) {
    match launch(data, extra).await {
        Started::Up(proc) => panic!(
            "koder-dns started although it should have refused; stderr:\n{}",
            proc.stderr()
        ),
        Started::Exited { status, stderr } => (status, stderr),
    }
}

impl Proc {
    pub fn base(&self) -> String {
        format!("{}://{}", if self.https { "https" } else { "http" }, self.http)
    }

    /// Sends `signal` (`HUP`, `TERM`, ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{signal} {} failed", self.child.id());
    }

    pub fn stderr(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// SIGTERM, then waits (up to 15s) for the exit.
    pub async fn terminate(mut self) -> (ExitStatus, String) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -TERM {pid} failed");
        let deadline = Instant::now() + Duration::from_secs(15);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "koder-dns did not exit within 15s of SIGTERM; stderr:\n{}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        (status, self.stderr())
    }

    /// SIGKILL: no chance to flush anything.
    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("wait");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// SIGTERM with exit code 0 asserted, then a fresh start on the same data directory.
pub async fn restart(proc: Proc, data: &Path, extra: &[&str]) -> Proc {
    let (status, stderr) = proc.terminate().await;
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM must exit 0 ({status}); stderr:\n{stderr}"
    );
    launch_ok(data, extra).await
}
