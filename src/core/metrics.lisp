;;;; metrics.lisp -- an engine's counters and gauges in Prometheus' text
;;;; exposition format 0.0.4, for a metrics URL of either front end.
;;;;
;;;; Nothing here runs per request: a request's answer and octets are
;;;; counted where they happen, in its stripe (engine.lisp, TALLY-COUNTS:
;;;; CONNECTION-COUNT-ANSWER, TALLY-ADD); a scrape sums the stripes
;;;; (ENGINE-COUNTS) and reads ENGINE-STATS, which walks the connection
;;;; table.  WRITE-METRICS is a pure function of those two and the limits,
;;;; so the format is tested without a server.
;;;;
;;;; Every family has its # HELP and # TYPE lines; the answers' counter has
;;;; a sample for every method and status class, zeros included, so that a
;;;; series exists from the first scrape and a rate over it starts at once.

(in-package #:gallop.core)

(sb-int:defconstant-eqx +metrics-content-type+ "text/plain; version=0.0.4; charset=utf-8"
  #'string=
  "The Content-Type of the text WRITE-METRICS writes.")

(defun write-metric-head (stream name type help)
  (format stream "# HELP ~A ~A~%# TYPE ~A ~A~%" name help name type))

(defun write-seconds (stream us)
  "The whole microseconds US as seconds, exactly: 1234567 as 1.234567."
  (multiple-value-bind (seconds rest) (floor us 1000000)
    (format stream "~D.~6,'0D" seconds rest)))

(sb-int:defconstant-eqx +metric-families+
    '(;; (name type help stats-key)
      ("gallop_connections_accepted_total" "counter"
       "Connections accepted." :accepted)
      ("gallop_connections_closed_total" "counter"
       "Connections closed." :closed)
      ("gallop_open_connections" "gauge"
       "Connections open now." :open)
      ("gallop_idle_connections" "gauge"
       "Open connections waiting in epoll with no thread: for a request, or for a client to read its answer."
       :idle)
      ("gallop_active_connections" "gauge"
       "Open connections a worker or a handler holds now." :active)
      ("gallop_upgraded_connections" "gauge"
       "Open connections that switched protocols (WebSockets)." :upgraded)
      ("gallop_pending_connections" "gauge"
       "Connections whose whole request head waits for a worker." :pending)
      ("gallop_in_flight_requests" "gauge"
       "Requests in their handler now, suspended ones included." :in-flight)
      ("gallop_suspended_requests" "gauge"
       "Requests an app answers later from another thread, waiting for that answer." :suspended)
      ("gallop_pool_threads" "gauge"
       "Worker threads in the pool." :threads)
      ("gallop_pool_idle_threads" "gauge"
       "Worker threads with nothing to serve." :idle-threads)
      ("gallop_pool_run_permits" "gauge"
       "Workers that may serve at once." :run-permits)
      ("gallop_shed_total" "counter"
       "Requests and connections answered 503 without a worker: the queue was full, or a budget spent."
       :shed)
      ("gallop_rejected_total" "counter"
       "Request heads the server refused itself (400, 408, 413, 414, 431, 501, 505)." :rejected)
      ("gallop_timeouts_total" "counter"
       "Connections and requests ended by a timeout or the minimum data rate." :timeouts)
      ("gallop_write_timeouts_total" "counter"
       "Connections closed because the client read nothing of its answer in time." :write-timeouts)
      ("gallop_waiting_writers" "gauge"
       "Writers waiting for their clients to read because the memory account refused what they write."
       :waiting-writers)
      ("gallop_writers_shed_total" "counter"
       "Connections closed because their writer would have waited for the client while memory was short and enough writers waited already."
       :writers-shed)
      ("gallop_aborted_total" "counter"
       "Requests whose client closed or reset the connection while a handler read or answered."
       :aborted)
      ("gallop_stop_cut_total" "counter"
       "Requests whose handler still ran when a stop gave up waiting: interrupted, and answered 503 if no answer had begun."
       :stop-cut)
      ("gallop_head_budget_used_bytes" "gauge"
       "Input buffers of partial request heads counted against the head budget." :head-bytes)
      ("gallop_body_budget_used_bytes" "gauge"
       "Request bodies held in memory, counted against the body budget." :body-bytes)
      ("gallop_body_disk_budget_used_bytes" "gauge"
       "Request bodies held in temporary files, counted against the disk budget." :disk-bytes))
  #'equal
  "The families WRITE-METRICS writes from ENGINE-STATS, one sample each.")

(defun write-metrics (stream stats counts &key head-budget body-budget disk-budget)
  "Write to STREAM, in Prometheus' text format 0.0.4, the metrics of STATS
\(a property list as ENGINE-STATS returns it), COUNTS (a vector as
ENGINE-COUNTS returns it) and the budgets' limits in octets.  Pure."
  (let ((methods +counted-methods+)
        (bounds +duration-bound-labels+))
    ;; Answers, by method and class.
    (write-metric-head stream "gallop_http_requests_total" "counter"
                       "Requests answered, by method and status class; the server's own refusals before a head was read count as method \"other\".")
    (dotimes (m (length methods))
      (dotimes (k +status-classes+)
        (format stream "gallop_http_requests_total{method=\"~A\",code=\"~Dxx\"} ~D~%"
                (svref methods m) (1+ k)
                (svref counts (+ +answer-cells+ (* +status-classes+ m) k)))))
    ;; Their durations: the buckets are counted apart, and written cumulative.
    (write-metric-head stream "gallop_http_request_duration_seconds" "histogram"
                       "Time from a request's complete head to the start of its answer, to the microsecond.")
    (let ((total 0))
      (dotimes (i (length bounds))
        (incf total (svref counts (+ +bucket-cells+ i)))
        (format stream "gallop_http_request_duration_seconds_bucket{le=\"~A\"} ~D~%"
                (svref bounds i) total))
      (incf total (svref counts (+ +bucket-cells+ (length bounds))))
      (format stream "gallop_http_request_duration_seconds_bucket{le=\"+Inf\"} ~D~%" total)
      (write-string "gallop_http_request_duration_seconds_sum " stream)
      (write-seconds stream (svref counts +duration-us-cell+))
      (terpri stream)
      (format stream "gallop_http_request_duration_seconds_count ~D~%" total))
    (flet ((one (name type help value)
             (write-metric-head stream name type help)
             (format stream "~A ~D~%" name value)))
      (one "gallop_received_bytes_total" "counter"
           "Octets read from clients' connections (on Gallop's own TLS, the plaintext)."
           (svref counts +bytes-in-cell+))
      (one "gallop_sent_bytes_total" "counter"
           "Octets clients' connections took (on Gallop's own TLS, the plaintext)."
           (svref counts +bytes-out-cell+))
      (one "gallop_tls_handshakes_total" "counter"
           "TLS handshakes completed."
           (svref counts +tls-handshakes-cell+))
      (loop for (name type help key) in +metric-families+
            do (one name type help (or (getf stats key) 0)))
      (one "gallop_head_budget_bytes" "gauge"
           "The head budget: octets of partial request heads' buffers, at most."
           (or head-budget 0))
      (one "gallop_body_budget_bytes" "gauge"
           "The body budget: octets of request bodies in memory, at most."
           (or body-budget 0))
      (one "gallop_body_disk_budget_bytes" "gauge"
           "The disk budget: octets of request bodies in temporary files, at most."
           (or disk-budget 0))
      ;; The memory account (account.lisp), process-wide.
      (write-metric-head stream "gallop_memory_bytes" "gauge"
                         "Octets held on behalf of clients by the servers of this process, by kind (the memory account).")
      (loop for (kind value) on (getf stats :memory) by #'cddr
            do (format stream "gallop_memory_bytes{kind=\"~(~A~)\"} ~D~%" kind value))
      (one "gallop_memory_limit_bytes" "gauge"
           "The memory account's limit: octets the heap's kinds (all but stacks) together may hold."
           (or (getf stats :memory-limit) 0))
      (one "gallop_overload_level" "gauge"
           "The overload manager's level: 0 normal, 1 largest holders not read, 2 new upgrades and large bodies refused, 3 largest holders closed."
           (or (getf stats :overload-level) 0))
      (write-metric-head stream "gallop_overload_actions_total" "counter"
                         "The overload manager's actions: connections left unread (paused), requests answered 503 (refused), connections closed (shed).")
      (loop for (action key) in '(("paused" :overload-paused) ("refused" :overload-refused)
                                  ("shed" :overload-shed))
            do (format stream "gallop_overload_actions_total{action=\"~A\"} ~D~%"
                       action (or (getf stats key) 0)))))
  nil)

(defun engine-metrics (engine)
  "ENGINE's metrics in Prometheus' text format 0.0.4 (WRITE-METRICS), as a
string, to be served with the Content-Type +METRICS-CONTENT-TYPE+."
  (with-output-to-string (stream)
    (write-metrics stream (engine-stats engine) (engine-counts engine)
                   :head-budget (engine-head-budget engine)
                   :body-budget (engine-body-budget engine)
                   :disk-budget (engine-disk-budget engine))))
