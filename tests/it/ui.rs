//! `GET /ui` in Debian's headless Chromium, driven over the WebDriver protocol (what
//! selenium speaks) through chromedriver: sign in with the key, see an instance appear, see
//! it go after its deregistration.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common;

#[tokio::test]
async fn ui_page_is_served_without_a_key_and_holds_no_data() {
    let server = common::start().await;
    server
        .register(json!({"id": "secret-1", "name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let response = server.http.get(server.url("/ui")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    let csp = response.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("default-src 'self'"), "{csp}");
    let page = response.text().await.unwrap();
    assert!(page.contains("id=\"login\""), "a sign-in form");
    assert!(!page.contains("secret-1"), "the page itself carries no registry data");
    assert!(
        !page.contains("http://") && !page.contains("https://"),
        "nothing from a CDN"
    );
    assert!(
        page.contains("const DEFAULT_TTL_NS = 90000000000;"),
        "the default lease is written in"
    );
}

struct Driver(Child);

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One WebDriver session.
struct Session {
    http: reqwest::Client,
    base: String,
}

impl Session {
    async fn call(&self, method: reqwest::Method, path: &str, body: Value) -> Value {
        let mut request = self.http.request(method, format!("{}{path}", self.base));
        // GET and DELETE carry no body; WebDriver refuses one.
        if !body.is_null() {
            request = request.json(&body);
        }
        let response = request.send().await.unwrap();
        let status = response.status();
        let value: Value = response.json().await.unwrap();
        assert!(status.is_success(), "WebDriver {path}: {status} {value}");
        value["value"].clone()
    }

    async fn find(&self, css: &str) -> Option<String> {
        let response = self
            .http
            .post(format!("{}/element", self.base))
            .json(&json!({"using": "css selector", "value": css}))
            .send()
            .await
            .unwrap();
        if !response.status().is_success() {
            return None;
        }
        let value: Value = response.json().await.unwrap();
        value["value"]
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .map(str::to_owned)
    }

    /// Waits up to 20 s for `css` to match (`present`) or to match nothing.
    async fn wait_for(&self, css: &str, present: bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.find(css).await.is_some() != present {
            if Instant::now() > deadline {
                let source = self.call(reqwest::Method::GET, "/source", Value::Null).await;
                panic!(
                    "{css} {} within 20s; page:\n{source}",
                    if present { "did not appear" } else { "did not go" }
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

#[tokio::test]
#[ignore = "needs chromium and chromium-driver (Debian packages)"]
async fn ui_in_chromium_with_a_read_key_shows_an_instance_and_drops_it_after_deregistration() {
    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("ports.toml");
    std::fs::write(
        &reference,
        "[[ports]]\nport = 5060\nprotocol = \"tcp\"\nservice = \"voice\"\n",
    )
    .unwrap();
    // The page signs in with the key of an edge proxy, scope read: all it needs.
    let token = koder_dns::access::new_token().unwrap();
    let keys = dir.path().join("keys.toml");
    std::fs::write(
        &keys,
        koder_dns::access::file_entry("edge", &token, koder_dns::access::Scope::Read, &[]),
    )
    .unwrap();
    let server = common::start_with(move |c| {
        c.drift_reference = Some(reference);
        c.keys_file = Some(keys);
    })
    .await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _driver = Driver(
        Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run chromedriver (apt-get install chromium-driver)"),
    );
    let profile = tempfile::tempdir().unwrap();
    let http = crate::common::http();
    let driver = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while http.get(format!("{driver}/status")).send().await.is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let capabilities = json!({"capabilities": {"alwaysMatch": {
        "browserName": "chrome",
        "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": [
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            "--no-first-run", format!("--user-data-dir={}", profile.path().display()),
        ]},
    }}});
    let created: Value = http
        .post(format!("{driver}/session"))
        .json(&capabilities)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = created["value"]["sessionId"]
        .as_str()
        .unwrap_or_else(|| panic!("no WebDriver session: {created}"));
    let session = Session {
        http,
        base: format!("{driver}/session/{id}"),
    };
    use reqwest::Method;

    session
        .call(Method::POST, "/url", json!({"url": server.url("/ui")}))
        .await;
    session.wait_for("#login:not(.hidden)", true).await;
    let field = session.find("#key").await.unwrap();
    session
        .call(Method::POST, &format!("/element/{field}/value"), json!({"text": token}))
        .await;
    let button = session.find("#sign-in").await.unwrap();
    session
        .call(Method::POST, &format!("/element/{button}/click"), json!({}))
        .await;
    session.wait_for("#main:not(.hidden)", true).await;
    // The key is kept for the session, not put in the address.
    let url = session.call(Method::GET, "/url", Value::Null).await;
    assert!(!url.as_str().unwrap().contains(&token), "{url}");

    // Before the registration the reference's port is missing from the registry.
    session.wait_for("tr[data-drift='missing']", true).await;
    server
        .register(
            json!({"id": "voice-ui-1", "name": "voice", "address": "10.0.0.1", "port": 5060,
                         "metadata": {"jet.domain": "voice.koder.dev"}}),
        )
        .await;
    session.wait_for("tr[data-instance-id='voice-ui-1']", true).await;
    session.wait_for("tr[data-domain='voice.koder.dev']", true).await;
    session.wait_for("tr[data-drift='missing']", false).await;
    server.deregister("voice-ui-1").await;
    session.wait_for("tr[data-instance-id='voice-ui-1']", false).await;

    // A wrong key is refused back to the form.
    session
        .call(
            Method::POST,
            "/execute/sync",
            json!({"script": "sessionStorage.setItem('koder-dns-key', 'wrong'); location.reload();", "args": []}),
        )
        .await;
    session.wait_for("#login:not(.hidden)", true).await;
    session.call(Method::DELETE, "", Value::Null).await;
}
