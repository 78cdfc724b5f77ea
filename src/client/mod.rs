//! A client library for koder-dns: a typed REST client ([`Client`]) and a [`Registrant`] that
//! keeps one instance registered for as long as its process lives.
//!
//! The client fails over between several registry URLs and retries only what is safe to
//! repeat: every route is idempotent (register is an upsert per R2, heartbeat renews, a
//! repeated deregister answers 404 which the caller treats as done), so a request whose answer
//! was lost is sent again to the next URL.

pub mod conformance;
mod registrant;
mod watcher;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;

pub use registrant::Registrant;
pub use watcher::Watcher;

pub use crate::export::routes::{Route, RouteInstance};
/// What a registrant sends and what the registry answers: the server's own type, so the two
/// cannot drift apart. Build one with struct update syntax over `Instance::default()`; a
/// field left at its default takes the registry's default (an empty `id` is
/// `<name>-<address>-<port>`, an empty `protocol` is `tcp`).
pub use crate::model::instance::Instance;

/// What a registry answered, sorted by what a caller does about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `410`: the lease is unknown or has run out; register again.
    #[error("the registry no longer knows this instance (410)")]
    Gone,
    /// `404`: no such instance (or route).
    #[error("not found: {0}")]
    NotFound(String),
    /// `401`: the API key is missing or wrong; retrying will not help.
    #[error("unauthorized: the registry refused the API key")]
    Unauthorized,
    /// `403`: the key is known, but its scope does not allow this (the message says what it
    /// may do); retrying will not help.
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// `400`: the request was invalid; `field` names what was wrong when the registry said.
    #[error("invalid {field}: {message}")]
    Invalid { field: String, message: String },
    /// `429`: too many requests or held watches; back off.
    #[error("too many requests: {0}")]
    TooMany(String),
    /// No registry URL answered (connection refused, timeout, `5xx`).
    #[error("registry unavailable: {0}")]
    Unavailable(String),
    /// Any other answer.
    #[error("unexpected answer {status}: {message}")]
    Unexpected { status: u16, message: String },
}

impl Error {
    /// Whether waiting and trying again may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable(_) | Error::TooMany(_))
    }
}

/// The answer to a registration.
#[derive(Debug, Clone, Deserialize)]
pub struct Registered {
    pub id: String,
    pub created: bool,
}

#[derive(Deserialize)]
struct InstanceList {
    instances: Vec<Instance>,
}

/// A REST client for one registry, reachable at one or more URLs.
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    urls: Vec<String>,
    api_key: String,
    timeout: Duration,
    /// The URL that answered last; requests start there.
    current: AtomicUsize,
}

impl Client {
    /// `urls` are base URLs such as `http://127.0.0.1:8053` (without `/api/v1`); requests time
    /// out after `timeout` per URL.
    pub fn new(urls: Vec<String>, api_key: impl Into<String>, timeout: Duration) -> anyhow::Result<Self> {
        Self::with_ca(urls, api_key, timeout, None)
    }

    /// [`Self::new`], trusting the CA certificates of the PEM file `ca` besides the system's
    /// roots, for `https://` URLs of a registry whose certificate a private CA signed.
    pub fn with_ca(
        urls: Vec<String>,
        api_key: impl Into<String>,
        timeout: Duration,
        ca: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        anyhow::ensure!(!urls.is_empty(), "at least one registry URL is needed");
        let http = crate::tls::trusting(crate::tls::client_builder(), ca)?
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()?;
        Ok(Self {
            http,
            urls: urls.into_iter().map(|u| u.trim_end_matches('/').to_owned()).collect(),
            api_key: api_key.into(),
            timeout,
            current: AtomicUsize::new(0),
        })
    }

    /// `POST /services/register`.
    pub async fn register(&self, registration: &Instance) -> Result<Registered, Error> {
        let body = serde_json::to_value(registration).expect("a registration serialises");
        self.json(reqwest::Method::POST, "/services/register", Some(&body))
            .await
    }

    /// `POST /services/heartbeat`: the renewed instance, or [`Error::Gone`].
    pub async fn heartbeat(&self, id: &str) -> Result<Instance, Error> {
        let body = serde_json::json!({ "id": id });
        self.json(reqwest::Method::POST, "/services/heartbeat", Some(&body))
            .await
    }

    /// `POST /services/deregister`.
    pub async fn deregister(&self, id: &str) -> Result<(), Error> {
        let body = serde_json::json!({ "id": id });
        self.send(reqwest::Method::POST, "/services/deregister", Some(&body))
            .await
            .map(drop)
    }

    /// `GET /services`: the names with a live instance.
    pub async fn services(&self) -> Result<Vec<String>, Error> {
        #[derive(Deserialize)]
        struct Names {
            services: Vec<String>,
        }
        let names: Names = self.json(reqwest::Method::GET, "/services", None).await?;
        Ok(names.services)
    }

    /// `GET /services?detail=1[&name=N]`: every live instance, or those of one service.
    pub async fn instances(&self, name: Option<&str>) -> Result<Vec<Instance>, Error> {
        let path = match name {
            Some(name) => format!("/services?detail=1&name={name}"),
            None => "/services?detail=1".to_owned(),
        };
        let list: InstanceList = self.json(reqwest::Method::GET, &path, None).await?;
        Ok(list.instances)
    }

    /// `GET /services/export`: koder-service-ports.toml (R8).
    pub async fn export(&self) -> Result<String, Error> {
        let response = self.send(reqwest::Method::GET, "/services/export", None).await?;
        response.text().await.map_err(|e| Error::Unavailable(e.to_string()))
    }

    /// `GET /routes?index=N&wait=D`: the revision (`X-Koder-Index`, 0 when the registry does
    /// not send it) and the edge-routing table, once the revision is above `index` or after
    /// `wait`.
    pub async fn routes(&self, index: u64, wait: Duration) -> Result<(u64, Vec<Route>), Error> {
        #[derive(Deserialize)]
        struct Routes {
            routes: Vec<Route>,
        }
        let path = format!("/routes?index={index}&wait={}ms", wait.as_millis());
        // The registry may hold the request for `wait` plus up to a sixteenth of jitter.
        let response = self
            .request(reqwest::Method::GET, &path, None, Some(self.timeout + wait + wait / 16))
            .await?;
        let revision = response
            .headers()
            .get("X-Koder-Index")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let status = response.status().as_u16();
        let routes: Routes = response.json().await.map_err(|e| Error::Unexpected {
            status,
            message: format!("undecodable body: {e}"),
        })?;
        Ok((revision, routes.routes))
    }

    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<T, Error> {
        let response = self.send(method, path, body).await?;
        let status = response.status().as_u16();
        response.json().await.map_err(|e| Error::Unexpected {
            status,
            message: format!("undecodable body: {e}"),
        })
    }

    /// Sends to the current URL, then to each other one in turn while the answer is a
    /// connection failure, a timeout or a `5xx`.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<reqwest::Response, Error> {
        self.request(method, path, body, None).await
    }

    /// [`Client::send`] with a timeout of its own for requests the registry may hold.
    async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
        timeout: Option<Duration>,
    ) -> Result<reqwest::Response, Error> {
        let start = self.current.load(Ordering::Relaxed);
        let mut last = Error::Unavailable("no URL tried".to_owned());
        for step in 0..self.urls.len() {
            let index = (start + step) % self.urls.len();
            let url = format!("{}/api/v1{path}", self.urls[index]);
            let mut request = self
                .http
                .request(method.clone(), &url)
                .header("X-API-Key", &self.api_key);
            if let Some(body) = body {
                request = request.json(body);
            }
            if let Some(timeout) = timeout {
                request = request.timeout(timeout);
            }
            match request.send().await {
                Ok(response) if response.status().is_server_error() => {
                    last = Error::Unavailable(format!("{url} answered {}", response.status()));
                }
                Ok(response) => {
                    self.current.store(index, Ordering::Relaxed);
                    return classify(response).await;
                }
                Err(e) => last = Error::Unavailable(format!("{url}: {e}")),
            }
        }
        Err(last)
    }
}

async fn classify(response: reqwest::Response) -> Result<reqwest::Response, Error> {
    let status = response.status().as_u16();
    if response.status().is_success() {
        return Ok(response);
    }
    let text = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or(text);
    Err(match status {
        410 => Error::Gone,
        404 => Error::NotFound(message),
        401 => Error::Unauthorized,
        403 => Error::Forbidden(message),
        429 => Error::TooMany(message),
        400 => Error::Invalid {
            // The registry's messages start with the field: "port: must be 1-65535".
            field: message.split(':').next().unwrap_or_default().trim().to_owned(),
            message,
        },
        _ => Error::Unexpected { status, message },
    })
}
