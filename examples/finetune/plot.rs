//! The loss curve as an SVG file: training loss per step and evaluation loss, on one chart,
//! written by hand (no plotting dependency).

use std::fmt::Write;

/// `train` and `eval` are `(step, loss)` points.
pub fn loss_svg(train: &[(usize, f64)], eval: &[(usize, f64)], title: &str) -> String {
    let (w, h, m) = (720.0, 400.0, 50.0);
    let all = train.iter().chain(eval).filter(|p| p.1.is_finite());
    let (mut x_max, mut y_min, mut y_max) = (1.0f64, f64::INFINITY, f64::NEG_INFINITY);
    for &(x, y) in all {
        x_max = x_max.max(x as f64);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if !y_min.is_finite() {
        (y_min, y_max) = (0.0, 1.0);
    }
    let y_span = (y_max - y_min).max(1e-9);
    let px = |x: usize| m + (x as f64 / x_max) * (w - 2.0 * m);
    let py = |y: f64| h - m - (y - y_min) / y_span * (h - 2.0 * m);
    let line = |pts: &[(usize, f64)]| {
        pts.iter()
            .filter(|p| p.1.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{tx}" y="20" text-anchor="middle" font-size="14">{title}</text>
<line x1="{m}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>
<line x1="{m}" y1="{m}" x2="{m}" y2="{b}" stroke="black"/>
<text x="{tx}" y="{xl}" text-anchor="middle">step (0 to {x_max})</text>
<text x="8" y="{m}">{y_max:.3}</text>
<text x="8" y="{b}">{y_min:.3}</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{tp}"/>
<polyline fill="none" stroke="#d62728" stroke-width="2" points="{ep}"/>
<text x="{r}" y="40" text-anchor="end" fill="#1f77b4">train loss</text>
<text x="{r}" y="56" text-anchor="end" fill="#d62728">eval loss</text>
</svg>
"##,
        tx = w / 2.0,
        b = h - m,
        r = w - m,
        xl = h - 15.0,
        tp = line(train),
        ep = line(eval),
    );
    s
}
