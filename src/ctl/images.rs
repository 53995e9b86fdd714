//! `sandboxctl images` (what a server has, through `GET /images`) and
//! `sandboxctl template` (a new image from a filesystem snapshot, built on
//! this host's image directory).

use crate::runtime::ImageInfo;

#[derive(Debug, thiserror::Error)]
pub enum ImagesError {
    #[error("cannot reach {url}: {source}")]
    Unreachable { url: String, source: reqwest::Error },
    #[error("{url} answered {status}: {body}")]
    Refused {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
}

/// The `http(s)://` form of a server URL given as `ws(s)://` or `http(s)://`.
pub fn http_base(url: &str) -> String {
    let url = url.trim_end_matches('/');
    if let Some(rest) = url.strip_prefix("ws://") {
        format!("http://{rest}")
    } else if let Some(rest) = url.strip_prefix("wss://") {
        format!("https://{rest}")
    } else {
        url.to_owned()
    }
}

/// `GET /images` of the server at `url`, as JSON.
/// `operator_token`: the operator credential (`/images` is an operator
/// surface for clients not on the server's machine).
pub async fn fetch_images(
    url: &str,
    operator_token: Option<&str>,
) -> Result<serde_json::Value, ImagesError> {
    let url = format!("{}/images", http_base(url));
    let unreachable = |source| ImagesError::Unreachable {
        url: url.clone(),
        source,
    };
    let http = crate::tls::http_client_builder()
        .build()
        .map_err(unreachable)?;
    let mut request = http.get(&url);
    if let Some(token) = operator_token.filter(|token| !token.is_empty()) {
        request = request.header(crate::api::state::OPERATOR_HEADER, token);
    }
    let response = request.send().await.map_err(unreachable)?;
    let status = response.status();
    if !status.is_success() {
        let body = response.text().await.unwrap_or_default();
        return Err(ImagesError::Refused { url, status, body });
    }
    response.json().await.map_err(unreachable)
}

/// The listing as a table: digest (shortened), names, default, packages.
pub fn render_images(listing: &serde_json::Value) -> String {
    let mut table = String::from(
        "DIGEST               NAMES                DEFAULT  BASE                 PACKAGES\n",
    );
    let images: Vec<ImageInfo> = listing["images"]
        .as_array()
        .map(|list| {
            list.iter()
                .filter_map(|image| {
                    Some(ImageInfo {
                        digest: image["digest"].as_str()?.to_owned(),
                        names: image["names"]
                            .as_array()
                            .map(|n| {
                                n.iter()
                                    .filter_map(|s| s.as_str().map(str::to_owned))
                                    .collect()
                            })
                            .unwrap_or_default(),
                        default: image["default"].as_bool().unwrap_or(false),
                        packages: image["packages"].as_array().map(|p| {
                            p.iter()
                                .filter_map(|s| s.as_str().map(str::to_owned))
                                .collect()
                        }),
                        base: image["base"].as_str().map(str::to_owned),
                        created_at: None,
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let short = |digest: &str| digest.chars().take(19).collect::<String>();
    for image in images {
        let names = if image.names.is_empty() {
            "-".to_owned()
        } else {
            image.names.join(",")
        };
        let packages = image
            .packages
            .map_or_else(|| "-".to_owned(), |p| p.join(" "));
        table.push_str(&format!(
            "{:<20} {:<20} {:<8} {:<20} {}\n",
            short(&image.digest),
            names,
            if image.default { "yes" } else { "" },
            image.base.as_deref().map_or_else(|| "-".to_owned(), short),
            packages
        ));
    }
    table
}
