;;;; nginx.lisp -- `make conformance`: the conformance corpus against nginx.
;;;;
;;;;   scripts/deps.sh nginx-light
;;;;   scripts/lisp.sh --eval '(asdf:load-system "gallop/tests")' \
;;;;     --load tests/conformance/nginx.lisp --eval '(gallop-tests::nginx-conformance-main)'
;;;;
;;;; Starts Debian's nginx as the benchmarks do (bench/run.lisp: a config in
;;;; a temporary directory, `nginx -p DIR -e DIR/error.log -c DIR/nginx.conf
;;;; -g "daemon off;"` as a child process, stopped with SIGTERM), listening
;;;; on a free port of 127.0.0.1.  It proxies every request to a second
;;;; server block that answers 200 and echoes what it got in an X-Seen
;;;; header: the proxy reads and checks the whole body first, as a Gallop app
;;;; does.  Its limits are Gallop's defaults as far as nginx can express them
;;;; (body 64 MiB, request line 64 KiB, 16 header buffers of 64 KiB).  Then
;;;; every case of the corpus goes to nginx and to Gallop's front ends,
;;;; and a table lists the cases where Gallop's status sequence, or the
;;;; corpus's verdict, differs from nginx's.  doc/conformance.md explains
;;;; each difference between the verdict and nginx; the cases it does not
;;;; name are listed at the end.

(in-package #:gallop-tests)

(load (merge-pathnames "../../bench/process.lisp"
                       (or *load-truename* *default-pathname-defaults*)))

(defparameter *repository*
  (merge-pathnames "../../" (make-pathname :name nil :type nil
                                           :defaults (or *load-truename*
                                                         *default-pathname-defaults*))))

(defun nginx-program ()
  (loop for dir in (append (uiop:split-string (or (uiop:getenv "PATH") "") :separator ":")
                           '("/usr/sbin" "/sbin"))
        for path = (format nil "~A/nginx" (string-right-trim "/" dir))
        when (and (plusp (length dir)) (probe-file path))
          return path))

(defun nginx-conformance-conf (dir port upstream-port)
  "nginx.conf for a run: the server on PORT proxies every request to the one
on UPSTREAM-PORT, which answers 200 and echoes what it got.  Proxying makes
nginx read (and decode, and check) the whole request body before anything
answers, as Gallop's apps do: a bare `return 200` answers at once and
discards the body afterwards, so no body error would ever show."
  (format nil "# Written by tests/conformance/nginx.lisp for one `make conformance` run.
worker_processes 1;
pid ~Anginx.pid;
error_log ~Aerror.log info;
events {
    worker_connections 1024;
}
http {
    access_log off;
    client_body_temp_path ~Abody;
    proxy_temp_path ~Aproxy;
    fastcgi_temp_path ~Afastcgi;
    uwsgi_temp_path ~Auwsgi;
    scgi_temp_path ~Ascgi;
    # Gallop's default limits, as far as nginx can say them.
    client_max_body_size 64m;
    large_client_header_buffers 16 64k;
    keepalive_timeout 5s;
    client_header_timeout 2s;
    client_body_timeout 2s;
    server {
        listen 127.0.0.1:~D;
        location / {
            proxy_pass http://127.0.0.1:~D;
            proxy_request_buffering on;
            # The client half-closes after its request: not an abort.
            proxy_ignore_client_abort on;
            # Room for the upstream's X-Seen header with a 60 KB target.
            proxy_buffer_size 128k;
            proxy_buffers 8 128k;
            proxy_busy_buffers_size 256k;
        }
    }
    server {
        listen 127.0.0.1:~D;
        location / {
            add_header X-Seen \"$request_method $request_uri $content_length\" always;
            return 200;
        }
    }
}
" dir dir dir dir dir dir dir port upstream-port upstream-port))

(defun connectable-p (port)
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (unwind-protect (handler-case (progn (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port) t)
                      (error () nil))
      (sb-bsd-sockets:socket-close socket))))

(defun call-with-nginx (function)
  "Start nginx on a free port, call FUNCTION with the port, stop nginx."
  (let* ((program (or (nginx-program)
                      (error "nginx not found; install it with scripts/deps.sh nginx-light")))
         (port (free-port))
         (upstream-port (loop for p = (free-port) unless (= p port) return p))
         (dir (format nil "/tmp/gallop-conformance-nginx-~D/" (sb-posix:getpid)))
         (process nil))
    (ensure-directories-exist dir)
    (with-open-file (out (format nil "~Anginx.conf" dir) :direction :output :if-exists :supersede)
      (write-string (nginx-conformance-conf dir port upstream-port) out))
    (unwind-protect
         (progn
           (setf process (sb-ext:run-program program
                                             (list "-p" dir "-e" (format nil "~Aerror.log" dir)
                                                   "-c" (format nil "~Anginx.conf" dir)
                                                   "-g" "daemon off;")
                                             :wait nil :input nil :output nil :error nil))
           (unless (loop repeat 100
                         thereis (connectable-p port)
                         do (unless (gallop-bench-process:alive-p process) (return nil))
                            (sleep 0.05))
             (error "nginx did not start (see ~Aerror.log)" dir))
           (funcall function port))
      (when (and process (gallop-bench-process:alive-p process))
        (sb-ext:process-kill process 15)
        (unless (gallop-bench-process:wait-exit process 5)
          (sb-ext:process-kill process 9)
          (gallop-bench-process:wait-exit process 5)))
      (when process (sb-ext:process-close process))
      (uiop:delete-directory-tree (pathname dir) :validate t :if-does-not-exist :ignore))))

(defun nginx-version ()
  (let ((out (make-string-output-stream)))
    (sb-ext:run-program (nginx-program) '("-v") :output out :error out)
    (string-trim '(#\Newline #\Space) (get-output-stream-string out))))

(defun format-statuses (statuses &optional then)
  (format nil "~:[-~;~:*~{~D~^ ~}~]~:[~; close~]" statuses (eq then :close)))

(defun documented-cases ()
  "The case names doc/conformance.md mentions (in backquotes)."
  (let ((doc (merge-pathnames "doc/conformance.md" *repository*)))
    (when (probe-file doc)
      (let ((text (uiop:read-file-string doc)))
        (remove-if-not (lambda (name) (search (format nil "`~A`" name) text))
                       (mapcar #'case-name (corpus-cases)))))))

(defun nginx-conformance-report (&optional (stream *standard-output*))
  "Run the corpus against nginx and Gallop's front ends; print the cases
where Gallop's status sequence differs from nginx's, or the corpus's verdict
does.  Returns the number of cases where the verdict and nginx differ and
doc/conformance.md does not explain it."
  (let* ((cases (corpus-cases))
         (gallop (loop for front-end in *conformance-front-ends*
                       collect (cons front-end
                                     (mapcar (lambda (r) (outcome-statuses (second r)))
                                             (run-corpus front-end)))))
         (nginx (call-with-nginx
                 (lambda (port)
                   (loop for case in cases
                         collect (outcome-statuses (run-case case port))))))
         (documented (documented-cases))
         (rows '()))
    (loop for case in cases
          for i from 0
          for spec = (expected-statuses case)
          for native = (nth i (cdr (assoc :native gallop)))
          for others-agree = (every (lambda (fe) (equal native (nth i (cdr (assoc fe gallop)))))
                                    *conformance-front-ends*)
          for theirs = (nth i nginx)
          unless (and others-agree (equal native theirs) (equal spec theirs))
            do (push (list (case-name case) (case-section case)
                           (format-statuses spec (case-then case))
                           (format nil "~A~:[!~;~]~:[*~;~]" (format-statuses native)
                                   (equal native spec) others-agree)
                           (format-statuses theirs)
                           (cond ((equal spec theirs) "")
                                 ((member (case-name case) documented :test #'string=) "yes")
                                 (t "NO")))
                     rows))
    (setf rows (nreverse rows))
    (format stream "~&Conformance corpus: ~D cases against ~A.~%~
                    ~D cases where Gallop or the corpus's verdict differ from nginx:~%~
                    spec    the status sequence the corpus expects (close: no answer)~%~
                    gallop  what GALLOP:START answered; ! not the spec's verdict, * its ~
                    front ends disagree~%~
                    doc     where spec and nginx differ: whether doc/conformance.md explains it~2%"
            (length cases) (nginx-version) (length rows))
    (let ((widths (loop for column from 0 below 6
                        collect (reduce #'max (cons (length (nth column '("case" "RFC" "spec" "gallop" "nginx" "doc")))
                                                    (mapcar (lambda (row) (length (nth column row))) rows))))))
      (flet ((print-row (row)
               (format stream "~{~A~^  ~}~%"
                       (loop for cell in row for w in widths
                             collect (format nil "~vA" w cell)))))
        (print-row '("case" "RFC" "spec" "gallop" "nginx" "doc"))
        (print-row (mapcar (lambda (w) (make-string w :initial-element #\-)) widths))
        (mapc #'print-row rows)))
    (let ((undocumented (remove "NO" rows :key #'sixth :test-not #'string=)))
      (when undocumented
        (format stream "~%Not explained in doc/conformance.md: ~{~A~^, ~}~%"
                (mapcar #'first undocumented)))
      (length undocumented))))

(defun nginx-conformance-main ()
  (handler-case (progn (nginx-conformance-report) (uiop:quit 0))
    (error (e)
      (format *error-output* "~&make conformance failed: ~A~%" e)
      (uiop:quit 1))))
