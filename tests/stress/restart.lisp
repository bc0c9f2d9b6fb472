;;;; restart.lisp -- restarts that drop nothing, under load (`make
;;;; test-restarts`, and part of `make test-stress`).  Each drill runs
;;;; `wrk -c100` for 10 s against Gallop processes (bench/server.lisp) and
;;;; restarts them, one at a time, with SIGTERM (GALLOP:STOP-ON-SIGTERM: a
;;;; soft stop, then exit) and a fresh process; the bar is wrk's: no socket
;;;; error and no non-2xx answer, and every process exits with status 0.
;;;; wrk's requests take turns between /yo (an answer the handler returns)
;;;; and /static (a file: Hunchentoot's HANDLE-STATIC-FILE, whose head goes
;;;; out through SEND-HEADERS before the handler returns; the native API's
;;;; pathname body), so that every way an answer's head is written meets
;;;; the stops.
;;;;   1. two processes on one port with :REUSE-PORT (plain, and TLS);
;;;;   2. one process on a socket the test passes it as systemd would (the
;;;;      socket, the test's, queues connections while no process runs);
;;;;   3. Debian's nginx in front of two processes on ports of their own.
;;;; Each on both front ends (native, easy-acceptor).

(in-package #:gallop-tests)

(def-suite restarts :in stress
  :description "Restarts under load that refuse, reset or fail no request.")
(in-suite restarts)

(defparameter *drill-seconds* 10 "How long wrk runs in each drill.")

(defun start-drill-server (kind port &key reuse-port tls socket)
  "bench/server.lisp serving KIND on PORT in a child process, with
:REUSE-PORT, TLS (the test certificate) or, with SOCKET, on that passed
socket (START-ACTIVATED-SERVER).  Returns the process once it said READY."
  (multiple-value-bind (process ready)
      (if socket
          (start-activated-server kind socket port)
          (let ((process (sb-ext:run-program
                          "scripts/lisp.sh"
                          (list "--load" "bench/server.lisp" "--end-toplevel-options"
                                kind (princ-to-string port) "0")
                          :wait nil :input :stream :output :stream :error nil
                          :environment (append
                                        (and reuse-port (list "BENCH_REUSE_PORT=1"))
                                        (and tls (destructuring-bind (cert key) (test-certificate)
                                                   (list (format nil "BENCH_TLS_CERT=~A" cert)
                                                         (format nil "BENCH_TLS_KEY=~A" key))))
                                        (sb-ext:posix-environ))
                          :directory (asdf:system-source-directory "gallop"))))
            (values process (read-line (sb-ext:process-output process) nil ""))))
    (unless (uiop:string-prefix-p "READY " ready)
      (stop-limited-server process)
      (error "The ~A server on port ~D did not start: ~S" kind port ready))
    process))

(defun terminate-drill-server (process)
  "SIGTERM PROCESS and wait for it to exit (at most a minute, then kill it).
Returns its exit code (NIL if it had to be killed)."
  (sb-ext:process-kill process sb-unix:sigterm)
  (let ((deadline (+ (get-internal-real-time) (* 60 internal-time-units-per-second))))
    (loop while (and (sb-ext:process-alive-p process)
                     (< (get-internal-real-time) deadline))
          do (sleep 0.05)))
  (prog1 (if (sb-ext:process-alive-p process)
             (progn (sb-ext:process-kill process 9) (sb-ext:process-wait process) nil)
             (sb-ext:process-exit-code process))
    (sb-ext:process-close process)))

(defun drill-served (process)
  "Requests the child server began, from its stats (0 if unknown)."
  (or (getf (limited-server-stats process) :requests) 0))

(defparameter *drill-paths* '("/yo" "/static")
  "The paths each of wrk's connections requests in turn.")

(defun drill-script ()
  "A wrk script (Lua) whose requests take turns among *DRILL-PATHS*;
written once into the run's directory.  Returns its file name."
  (let ((file (merge-pathnames "drill-paths.lua" (run-directory))))
    (with-open-file (out file :direction :output :if-exists :supersede)
      (format out "local paths = {~{~S~^, ~}}
local i = 0
request = function()
  i = i % #paths + 1
  return wrk.format(nil, paths[i])
end
" *drill-paths*))
    (namestring file)))

(defun run-drill (url slots)
  "Run wrk -t2 -c100 against URL (its paths: *DRILL-PATHS*) for
*DRILL-SECONDS*, restarting each of SLOTS in turn meanwhile.  A slot is a
cons (PROCESS . START), START a function of no argument that starts its
replacement.  Returns wrk's output, the exit codes of the stopped processes,
and the requests each replacement served by the end."
  (let* ((output nil)
         (script (drill-script))
         (wrk (sb-thread:make-thread
               (lambda ()
                 (setf output
                       (with-output-to-string (out)
                         (sb-ext:run-program "wrk" (list "-t2" "-c100"
                                                         (format nil "-d~Ds" *drill-seconds*)
                                                         ;; A restart under socket activation
                                                         ;; holds requests while SBCL starts.
                                                         "--timeout" "10s" "-s" script url)
                                             :search t :output out :error out))))
               :name "wrk"))
         (codes '()))
    ;; One restart after another, each once the load ran 1.5 s more: a
    ;; process stops and its replacement starts (SBCL loading Gallop takes
    ;; a second or two), all within wrk's run.
    (dolist (slot slots)
      (sleep 1.5)
      (cond ((sb-thread:thread-alive-p wrk)
             (push (terminate-drill-server (car slot)) codes)
             (setf (car slot) (funcall (cdr slot))))
            (t (push nil codes))))
    (sb-thread:join-thread wrk)
    (values output (nreverse codes) (mapcar (lambda (slot) (drill-served (car slot))) slots))))

(defun check-drill (what output codes served)
  (multiple-value-bind (completed errors) (wrk-report output)
    (is (and completed (plusp completed)) "~A: wrk completed ~A requests~%~A" what completed output)
    (is (not errors) "~A: wrk saw errors~%~A" what output))
  ;; NIL: wrk had ended before that restart began.
  (is (every (lambda (code) (eql 0 code)) codes) "~A: exit codes ~S" what codes)
  ;; The first process restarted takes the load of the next one stopped
  ;; (wrk's keep-alive connections move only when the server closes them).
  (is (plusp (first served)) "~A: the restarted processes served ~S requests" what served))

(defun stop-drill-slots (slots)
  (dolist (slot slots)
    (when (and (car slot) (sb-ext:process-alive-p (car slot)))
      (stop-limited-server (car slot)))))

(defun drill-reuse-port (kind &key tls)
  (let* ((port (free-port))
         (start (lambda () (start-drill-server kind port :reuse-port t :tls tls)))
         (slots (list (cons (funcall start) start) (cons (funcall start) start))))
    (unwind-protect
         (multiple-value-call #'check-drill
           (format nil "~A, two processes on one port~:[~;, TLS~]" kind tls)
           (run-drill (format nil "~:[http~;https~]://127.0.0.1:~D/yo" tls port) slots))
      (stop-drill-slots slots))))

(test two-processes-on-one-port-restart-in-turn
  (drill-reuse-port "native")
  (drill-reuse-port "gallop"))

(test two-tls-processes-on-one-port-restart-in-turn
  (drill-reuse-port "native" :tls t)
  (drill-reuse-port "gallop" :tls t))

(test a-process-on-a-passed-socket-restarts
  (dolist (kind '("native" "gallop"))
    (multiple-value-bind (socket port) (make-passed-socket)
      (let* ((start (lambda () (start-drill-server kind port :socket socket)))
             (slots (list (cons (funcall start) start))))
        (unwind-protect
             (multiple-value-call #'check-drill (format nil "~A, a passed socket" kind)
               (run-drill (format nil "http://127.0.0.1:~D/yo" port) slots))
          (stop-drill-slots slots)
          (sb-bsd-sockets:socket-close socket))))))

(defun nginx-in-front (port upstream-ports)
  "Debian's nginx on PORT proxying to UPSTREAM-PORTS as examples/deploy/
nginx.conf does, in a temporary directory.  Returns the process."
  (let* ((dir (uiop:ensure-directory-pathname
               (merge-pathnames (format nil "nginx-~D/" port) (run-directory))))
         (conf (merge-pathnames "nginx.conf" dir)))
    (ensure-directories-exist dir)
    (with-open-file (out conf :direction :output :if-exists :supersede)
      (format out "worker_processes 1;
pid ~Anginx.pid;
error_log ~Aerror.log warn;
events { worker_connections 1024; }
http {
    access_log off;
    client_body_temp_path ~Abody;
    proxy_temp_path ~Aproxy;
    fastcgi_temp_path ~Afastcgi;
    uwsgi_temp_path ~Auwsgi;
    scgi_temp_path ~Ascgi;
    upstream gallop {
~{        server 127.0.0.1:~D max_fails=0;~%~}        keepalive 64;
        keepalive_timeout 15s;
    }
    server {
        listen 127.0.0.1:~D;
        location / {
            proxy_pass http://gallop;
            proxy_http_version 1.1;
            proxy_set_header Connection \"\";
            proxy_next_upstream error timeout http_502 http_503;
            proxy_next_upstream_tries 2;
        }
    }
}
" dir dir dir dir dir dir dir upstream-ports port))
    (let ((process (sb-ext:run-program (if (probe-file "/usr/sbin/nginx") "/usr/sbin/nginx" "nginx")
                                       (list "-p" (namestring dir)
                                             "-e" (format nil "~Aerror.log" dir)
                                             "-c" (namestring conf) "-g" "daemon off;")
                                       :search t :wait nil :output nil :error nil)))
      (unless (wait-until (lambda () (ignore-errors (usocket:socket-close (connect port)) t))
                          :timeout 10)
        (sb-ext:process-kill process 9)
        (error "nginx did not start on port ~D" port))
      process)))

(test nginx-in-front-of-two-processes-restarted-in-turn
  (dolist (kind '("native" "gallop"))
    (let* ((all (loop with ports = '()
                      until (= 3 (length ports))
                      do (pushnew (free-port) ports)
                      finally (return ports)))
           (port (first all))
           (ports (rest all))
           (slots (mapcar (lambda (port)
                            (let ((start (lambda () (start-drill-server kind port))))
                              (cons (funcall start) start)))
                          ports))
           (nginx nil))
      (unwind-protect
           (progn
             (setf nginx (nginx-in-front port ports))
             (multiple-value-call #'check-drill (format nil "~A behind nginx" kind)
               (run-drill (format nil "http://127.0.0.1:~D/yo" port) slots)))
        (when nginx
          (sb-ext:process-kill nginx sb-unix:sigterm)
          (sb-ext:process-wait nginx))
        (stop-drill-slots slots)))))
